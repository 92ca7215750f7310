#!/usr/bin/env bash
# The GPU checks of the CUDA backend, on a machine with an NVIDIA GPU, within a deadline
# (GPU_CHECK_DEADLINE_S, default 480 s) that every step's own time limit respects:
#   0. the machine: driver, the CUDA version it supports, the bundle's CUDA runtime, cuBLAS;
#   1. a smoke pass (under 60 s, CUDA_LAUNCH_BLOCKING=1): device discovery, the host-side tests and
#      the fp32 GEMMs, so that a broken setup shows in the first minute;
#   2. the GPU tests, one suite per process (one sticky CUDA error cannot fail the suites after
#      it): every op against the CPU backend, the Qwen3 q/k norm, the MoE block, gpt-oss's sinks and
#      sliding-window attention, yarn RoPE, clamped SwiGLU and stacked biased experts, and the whole
#      training steps of Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral and gpt-oss. A skipped test is a
#      failure, except the one that checks the refusal without a GPU;
#   3. H2D/D2H bandwidth by size, bf16 GEMM TFLOP/s at the layer shapes of a ~1B and a 7B model;
#   4. streamed training steps of a ~1B model (TinyLlama-1.1B's shape) and a 7B-shaped model
#      (Llama-2-7B's layers, 8 of its 32, so that its training state fits the machine's RAM), with
#      achieved TFLOP/s, MFU, the ratio to the GEMM rate, and the simulator's prediction; the
#      first loss must be within 1 of ln V and the loss must fall (check_loss);
#   5. the Python package: examples/finetune.py with a transformers model object, and the saved
#      folder loaded back by transformers (when the bundle has the package and python3 imports it);
#   6. compute-sanitizer memcheck on the attention, MoE and cross-entropy op tests, when a minute
#      or more is left;
# as far as the deadline allows. It prints its table however it ends (an EXIT trap): a step that
# hung, failed or was not reached is a row that says so. Build on the Debian machine first
# (scripts/build-gpu-bundle.sh), carry gpu-bundle/, and run from the repository root:
#   scripts/gpu-check.sh [bundle-dir]       (default gpu-bundle)
# Results go to $OUT (default /tmp/gpu-check): logs, JSON and the plans. Exit 0 when every check ran
# and every test passed; 1 otherwise; 2 when the machine or the bundle cannot run the checks.
# tests/cli/gpu_check_cli.sh runs it here with a stand-in nvidia-smi and stand-in programs.
set -uo pipefail
cd "$(dirname "$0")/.."
B=$(realpath "${1:-gpu-bundle}")
OUT=${OUT:-/tmp/gpu-check}
DEADLINE=${GPU_CHECK_DEADLINE_S:-480}
mkdir -p "$OUT"
: >"$OUT/tests.txt"
: >"$OUT/runs.txt"
: >"$OUT/steps.txt"
export MEGATRAIN_PROFILES_DIR=$PWD/profiles
t0=$(date +%s)
gpu="(not found)"
elapsed() { echo $(($(date +%s) - t0)); }
exec 3>&2  # the console, also inside steps whose stderr goes to their log
say() { echo "[gpu-check $(elapsed)s] $*" >&3; }
failures=0
fail() {
  say "FAILED: $*"
  failures=$((failures + 1))
  echo "FAILED $*" >>"$OUT/steps.txt"
}

# ---- the deadline -----------------------------------------------------------------------------------
# The seconds a step may take: its own limit, cut to what is left before the deadline less 10 s
# for the table. A step with nothing left is not run, and counts as a failure.
budget() {
  local left=$((DEADLINE - 10 - $(elapsed)))
  if [ "$left" -lt "$1" ]; then echo $((left > 0 ? left : 0)); else echo "$1"; fi
}
# A step that was not run has its failure already: `within ... || not_run || fail ...`.
not_run() { [ $? -eq 125 ]; }
within() {  # limit command...: the command's status; 124 when it ran out of time; 125 when not run
  local limit
  limit=$(budget "$1")
  shift
  if [ "$limit" -le 0 ]; then
    fail "not run: the deadline of $DEADLINE s has passed ($(basename "$1") ${*:2})"
    return 125
  fi
  timeout -k 2 "$limit" "$@"
}

# ---- the table, however the run ends ----------------------------------------------------------------
table() {
  if ! command -v python3 >/dev/null; then
    echo "## gpu-check: $gpu (no python3: the raw results)"
    cat "$OUT/steps.txt" "$OUT/tests.txt" "$OUT/runs.txt"
    return
  fi
  timeout 20 python3 - "$OUT" "$gpu" <<'PYEOF'
import json, os, re, statistics, sys
out, gpu = sys.argv[1], sys.argv[2]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception:
        return None
def lines(name):
    try:
        return [l.rstrip("\n") for l in open(os.path.join(out, name)) if l.strip()]
    except OSError:
        return []
def num(x, spec, missing="?"):
    return spec % x if isinstance(x, (int, float)) else missing
print()
print("## gpu-check: " + gpu)
print()
print("| check | result |")
print("|---|---|")
for line in lines("versions.txt"):
    key, _, value = line.partition(": ")
    print("| %s | %s |" % (key, value))
for line in lines("tests.txt"):
    print("| tests %s | %s |" % (line.split()[0], " ".join(line.split()[1:])))
for line in lines("moe-gemm-path.txt"):
    print("| MoE expert GEMMs | %s |" % line.strip().replace("|", "/"))
bw = load("bandwidth.json")
if bw and bw.get("sizes"):
    rows = bw["sizes"]
    best = lambda key: max((r.get(key) or 0) for r in rows)
    print("| H2D / D2H / both at once (best size) | %.1f / %.1f / %.1f GB/s (pinned %sx pageable) |" % (
        best("h2d_gbs"), best("d2h_gbs"), best("bidirectional_sum_gbs"), num(bw.get("pinned_over_pageable_h2d"), "%.1f")))
peak = {}
for tag in ("1b", "7b"):
    g = load("gemm-%s.json" % tag)
    if g and isinstance(g.get("layer"), dict) and isinstance(g["layer"].get("forward_backward_tflops"), (int, float)):
        peak[tag] = g["layer"]["forward_backward_tflops"]
        print("| bf16 GEMMs, %s layer shapes (%s tokens) | %.0f TFLOP/s; 8192^3: %s TFLOP/s |" % (
            g.get("model", tag), g.get("tokens", "?"), peak[tag], num((g.get("reference") or {}).get("tflops"), "%.0f")))
for line in lines("runs.txt"):
    label, plan, sim, log = line.split()
    s = load(os.path.basename(sim)) or {}
    try:
        text = open(log, errors="replace").read()
    except OSError:
        text = ""
    tps = [float(m) for m in re.findall(r"step\s+\d+/\d+\s+loss\s+[-\d.naif]+\s+(\d+)\s+tokens/s", text)]
    loss = re.findall(r"loss\s+([-\d.]+)", text)
    if len(tps) < 3:
        last = text.strip().splitlines()[-1][:160] if text.strip() else "no output"
        print("| train %s | did not finish: %s |" % (label, last.replace("|", "/")))
        continue
    tokens, flops, pred = s.get("tokens_per_step"), s.get("flops_per_step"), s.get("step_time_s")
    measured = statistics.median([tokens / t for t in tps[2:]]) if isinstance(tokens, (int, float)) else None
    achieved = flops / measured / 1e12 if isinstance(flops, (int, float)) and measured else None
    error = "%+.1f%%" % (100 * (pred - measured) / measured) if isinstance(pred, (int, float)) and measured else "no prediction"
    ref = peak.get("1b" if label == "1b" else "7b")
    print("| train %s | step %s s measured (median of steps 3-6), %s s predicted (%s); %s TFLOP/s, MFU %s%s; loss %s -> %s |" % (
        label, num(measured, "%.3f"), num(pred, "%.3f"), error, num(achieved, "%.0f"),
        num(100 * achieved / 989.0 if achieved else None, "%.1f%%"),
        ", %.0f%% of the layer GEMM rate" % (100 * achieved / ref) if ref and achieved else "",
        loss[0] if loss else "?", loss[-1] if loss else "?"))
for line in lines("steps.txt"):
    print("| %s |" % line.replace("|", "/").replace("FAILED ", "failed | ", 1))
PYEOF
}
finish() {
  local rc=$?
  trap - EXIT
  table || echo "gpu-check: the table could not be printed; the results are in $OUT" >&2
  say "failures: $failures (logs and JSON in $OUT)"
  [ "$rc" -ne 0 ] && exit "$rc"
  [ "$failures" -eq 0 ] && exit 0
  exit 1
}
trap finish EXIT
trap 'fail "interrupted"; exit 1' INT TERM

# ---- 0. the machine and the bundle ------------------------------------------------------------------
if ! command -v python3 >/dev/null; then
  echo "gpu-check: python3 is needed (the training tokens and the table); install it or put it on PATH" >&2
  exit 2
fi
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi finds none); run it on the GPU machine" >&2
  exit 2
fi
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
driver_cuda=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | head -1 | grep -o '[0-9.]*$')
{
  echo "GPU: $gpu"
  echo "CUDA version the driver supports: ${driver_cuda:-unknown}"
  echo "bundle built with: $(cat "$B/BUILD-INFO.txt" 2>/dev/null | tr '\n' ' ' || echo unknown)"
} >"$OUT/versions.txt"
# cuBLAS (the one CUDA library the bundle loads from the machine): the loader's cache, $CUDA_HOME,
# the usual install folders, then a Python wheel's copy; the first folder that has it joins
# LD_LIBRARY_PATH.
cublas_dir=""
if ldconfig -p 2>/dev/null | grep -q 'libcublas\.so\.13 '; then
  cublas_dir=$(dirname "$(ldconfig -p | grep -m1 'libcublas\.so\.13 ' | sed 's/.*=> //')")
else
  wheel=$(python3 -c 'import os, nvidia.cublas as c; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null || true)
  for d in ${CUDA_HOME:+$CUDA_HOME/lib64} /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 ${wheel:+$wheel}; do
    if [ -e "$d/libcublas.so.13" ]; then cublas_dir=$d; break; fi
  done
fi
if [ -n "$cublas_dir" ]; then
  export LD_LIBRARY_PATH=$cublas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "cuBLAS: $(readlink -f "$cublas_dir/libcublas.so.13" 2>/dev/null || echo "$cublas_dir/libcublas.so.13")" >>"$OUT/versions.txt"
else
  echo "cuBLAS: libcublas.so.13 not found (ldconfig, \$CUDA_HOME, /usr/local/cuda*/lib64, the nvidia-cublas wheel)" >>"$OUT/versions.txt"
fi
say "$(tr '\n' ';' <"$OUT/versions.txt"); glibc $(ldd --version | head -1 | grep -o '[0-9.]*$'); $(nproc) cores; deadline $DEADLINE s"
for f in megatrain-exec megatrain-plan megatrain-bench-cuda megatrain_kernels_tests megatrain_executor_tests; do
  [ -x "$B/$f" ] || { echo "gpu-check: $B/$f is missing; build it with scripts/build-gpu-bundle.sh" >&2; exit 2; }
  if ldd "$B/$f" 2>/dev/null | grep -q "not found"; then
    echo "gpu-check: $f cannot load: $(ldd "$B/$f" | grep 'not found' | tr '\n' ' ')" >&2
    exit 2
  fi
done

# ---- GPU tests -----------------------------------------------------------------------------------------
# One run of a test program: passed, failed and skipped tests counted once each by name; a skip
# other than the expected one, a run that matched no test, and a non-zero exit are failures.
expected_skip='CudaTraining.WithoutAGpuCudaIsRefusedWithTheReason'
run_tests() {  # name, limit, binary, filter
  local name=$1 limit=$2 bin=$3 filter=$4 log="$OUT/tests-$1.log" rc
  within "$limit" "$bin" --gtest_filter="$filter" >"$log" 2>&1
  rc=$?
  [ "$rc" -eq 125 ] && { echo "$name not run (deadline)" >>"$OUT/tests.txt"; return; }
  local passed failed skipped unexpected
  passed=$(grep -o '^\[       OK \] [^ ]*' "$log" | sort -u | wc -l)
  failed=$(grep -oE '^\[  FAILED  \] [^ ]+\.[^ ]+' "$log" | awk '{print $NF}' | sort -u)
  skipped=$(grep -oE '^\[  SKIPPED \] [^ ]+\.[^ ]+' "$log" | awk '{print $NF}' | sort -u)
  unexpected=$(echo "$skipped" | grep -v -x -F "$expected_skip" | grep . || true)
  echo "$name passed=$passed failed=$(echo "$failed" | grep -c .) skipped=$(echo "$skipped" | grep -c .) rc=$rc" >>"$OUT/tests.txt"
  if [ "$rc" -eq 124 ]; then fail "tests $name: still running after its limit (a hang?)"
  elif [ "$rc" -ne 0 ]; then fail "tests $name (rc $rc): $(echo "$failed" | head -5 | tr '\n' ' ')"
  elif [ "$passed" -eq 0 ] && [ -z "$skipped" ]; then fail "tests $name: the filter $filter matched no test"
  fi
  [ -n "$unexpected" ] && fail "tests $name: skipped, which on a GPU machine means the GPU was not usable: $(echo "$unexpected" | head -3 | tr '\n' ' ')"
  return 0
}
suites() {  # binary, pattern: the test suites whose names match, from --gtest_list_tests
  within 20 "$1" --gtest_list_tests 2>/dev/null | grep -E '^[^ ].*\.' | sed 's/\..*//' | grep -E "$2" | sort -u
}
say "smoke pass (CUDA_LAUNCH_BLOCKING=1)"
CUDA_LAUNCH_BLOCKING=1 run_tests smoke 60 "$B/megatrain_kernels_tests" \
  'CudaDevice.*:CudaHostSide.*:AttentionSchedule.*:TokenGroups.*:CudaGemmT/fp32_fp32.*'
say "op tests, one suite per process"
for s in $(suites "$B/megatrain_kernels_tests" '^(CudaOps|CudaGemm|Shapes/)'); do
  run_tests "kernels:$s" 120 "$B/megatrain_kernels_tests" "$s.*"
done
grep -h 'grouped GEMMs' "$OUT"/tests-kernels:CudaOps*.log 2>/dev/null | sed 's/^.* \(fp32\|bf16\): /\1 /' | sort -u \
  >"$OUT/moe-gemm-path.txt" || true
say "executor CUDA tests"
for s in CudaLayout CudaTraining MakeBackend; do run_tests "executor:$s" 240 "$B/megatrain_executor_tests" "$s.*"; done
cat "$OUT/tests.txt" >&2

# ---- bandwidth and GEMMs at the layer shapes -------------------------------------------------------------
say "H2D/D2H bandwidth"
within 90 "$B/megatrain-bench-cuda" bandwidth --json >"$OUT/bandwidth.json" 2>"$OUT/bandwidth.log" || not_run || fail "bandwidth"
say "bf16 GEMMs"
within 90 "$B/megatrain-bench-cuda" gemm --model llama-2-7b --seq 2048 --micro-batch 4 --json >"$OUT/gemm-7b.json" \
  2>"$OUT/gemm-7b.log" || not_run || fail "gemm 7b"
within 60 "$B/megatrain-bench-cuda" gemm --model tinyllama-1.1b --seq 2048 --micro-batch 8 --json >"$OUT/gemm-1b.json" \
  2>"$OUT/gemm-1b.log" || not_run || fail "gemm 1b"

# ---- streamed training steps ------------------------------------------------------------------------------
say "rig profile (quick)"
rig="$OUT/rig.json"
within 120 "$B/megatrain-plan" profile --quick -o "$rig" >"$OUT/profile.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ]; then
  [ "$rc" -eq 125 ] || fail "profile --quick (the shipped h200-1.5tb profile is used for the predictions)"
  rig=h200-1.5tb
else
  # cuBLAS by shape (issue 50): each op's efficiency at every cell of the grid, tokens by rows.
  python3 - "$rig" <<'PYEOF' | tee "$OUT/gemm_shapes.txt" || fail "the profile's gemm_shapes"
import json, sys
g = json.load(open(sys.argv[1]))["gpu"].get("gemm_shapes")
if g is None:
    sys.exit("the profile has no gpu.gemm_shapes")
t, i, o = g["tokens"], g["in"], g["out"]
print(f"gemm_shapes: fraction of the bf16 peak by (tokens, in, out); {g['provenance']['source']}")
for op in ("forward", "backward_data", "backward_weight"):
    e = g[op]
    for a, tok in enumerate(t):
        cells = " ".join(f"{int(x)}->{int(y)}:{e[(a * len(i) + b) * len(o) + c]:.2f}" for b, x in enumerate(i) for c, y in enumerate(o))
        print(f"  {op:15} tokens {int(tok):6}  {cells}")
PYEOF
fi
within 60 python3 - "$OUT" <<'PYEOF' || not_run || fail "the training tokens and the 7B-shaped config"
import json, os, random, struct, sys
out = sys.argv[1]
cfg = json.load(open(os.path.join(os.environ["MEGATRAIN_PROFILES_DIR"], "models", "llama-2-7b.json")))
cfg["num_hidden_layers"] = 8  # Llama-2-7B's layer shapes; 8 of its 32 layers keep the state in RAM
json.dump(cfg, open(os.path.join(out, "llama-2-7b-8l.json"), "w"), indent=1)
rng = random.Random(1)
n = 1 << 22  # 4M tokens, more than the steps read
# 1024 of the 32000 token ids, uniformly: at initialisation the model spreads its probability over
# all 32000 (loss near ln 32000 = 10.37), and a working step learns within a few steps that only
# 1024 occur (towards ln 1024 = 6.93), so the loss must fall.
ids = rng.sample(range(32000), 1024)
with open(os.path.join(out, "tokens.u16"), "wb") as f:
    f.write(struct.pack("<%dH" % n, *(rng.choice(ids) for _ in range(n))))
PYEOF
# The losses of a training run: the first close to ln V, as an initialised model's must be, and the
# last below the first. With init std 0.02 the logits spread by sigma = 0.02 sqrt(hidden), 0.9 at a
# hidden size of 2048, and the first loss is about ln V + sigma^2 / 2, 0.4 above ln V: within 1 of
# it. The 1024 ids of the tokens make a working step lower the loss by more than 0.05 in 6 steps.
check_loss() {  # label, model (a profile name or a config path)
  within 20 python3 - "$OUT/exec-$1.log" "$2" >"$OUT/loss-$1.txt" 2>&1 <<'PYEOF'
import json, math, os, re, sys
log, model = sys.argv[1], sys.argv[2]
path = model if os.path.exists(model) else os.path.join(os.environ["MEGATRAIN_PROFILES_DIR"], "models", model + ".json")
vocab = json.load(open(path))["vocab_size"]
losses = [float(x) for x in re.findall(r"step\s+\d+/\d+\s+loss\s+([-\d.naif]+)", open(log, errors="replace").read())]
if len(losses) < 2:
    sys.exit("%d losses in %s; 2 or more were expected" % (len(losses), log))
first, last = losses[0], losses[-1]
if not all(math.isfinite(x) for x in losses):
    sys.exit("a loss is not finite: %s" % losses)
if abs(first - math.log(vocab)) > 1.0:
    sys.exit("the first loss %.3f is not within 1 of ln V = %.3f (V = %d)" % (first, math.log(vocab), vocab))
if not last < first - 0.05:
    sys.exit("the loss did not fall: %.3f -> %.3f over %d steps" % (first, last, len(losses)))
print("loss %.3f (ln V = %.3f) -> %.3f" % (first, math.log(vocab), last))
PYEOF
  local rc=$?
  [ "$rc" -eq 125 ] || [ "$rc" -eq 0 ] || fail "train $1: $(tail -1 "$OUT/loss-$1.txt")"
}
train() {  # label, model, tokens per step
  local label=$1 model=$2 tps=$3 plan="$OUT/plan-$1.json"
  say "plan $label"
  within 60 "$B/megatrain-plan" plan -m "$model" -r "$rig" --seq 2048 --tokens-per-step "$tps" --steps 6 \
    -o "$plan" >"$OUT/plan-$label.log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 125 ] || fail "plan $label: $(tail -2 "$OUT/plan-$label.log" | tr '\n' ' ')"
    return
  fi
  within 30 "$B/megatrain-plan" simulate "$plan" --json >"$OUT/sim-$label.json" 2>>"$OUT/plan-$label.log" || not_run ||
    fail "simulate $label"
  say "train $label"
  echo "$label $plan $OUT/sim-$label.json $OUT/exec-$label.log" >>"$OUT/runs.txt"
  within 240 "$B/megatrain-exec" "$plan" --data "$OUT/tokens.u16" --steps 6 --backend cuda \
    --trace "$OUT/measured-$label.mtrace" >"$OUT/exec-$label.log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then check_loss "$label" "$model"
  elif [ "$rc" -ne 125 ]; then fail "exec $label: $(tail -3 "$OUT/exec-$label.log" | tr '\n' ' ')"
  fi
}
train 1b tinyllama-1.1b 65536
train 7b-shaped "$OUT/llama-2-7b-8l.json" 65536

# ---- the Python package (issue 33) --------------------------------------------------------------------
# examples/finetune.py through the bundle's package (when this python3 can import it: the module is
# built for the build machine's Python), with a transformers model object where transformers is
# installed, on this machine's rig; then the saved folder loaded back with transformers'
# AutoModelForCausalLM.from_pretrained. Not run (a row saying why) without the package.
if [ ! -d "$B/python/megatrain" ] || [ ! -d "$B/tiny-model" ]; then
  echo "python not run (the bundle has no Python package or tiny model: scripts/build-gpu-bundle.sh says why)" >>"$OUT/tests.txt"
elif ! PYTHONPATH="$B/python" python3 -c 'import megatrain' >"$OUT/python-import.log" 2>&1; then
  echo "python not run (this python3 cannot import the bundle's package: $(tail -1 "$OUT/python-import.log" | tr '|' '/'))" >>"$OUT/tests.txt"
else
  say "examples/finetune.py"
  rm -rf "$OUT/finetune"
  within 240 env MEGATRAIN_RIG="$rig" PYTHONPATH="$B/python" python3 examples/finetune.py "$B/tiny-model" \
    tests/data/sft/alpaca-sample.jsonl "$OUT/finetune" 20 >"$OUT/finetune.log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then
    if python3 -c 'import transformers' 2>/dev/null; then
      within 120 python3 - "$OUT/finetune" >"$OUT/finetune-load.log" 2>&1 <<'PYEOF'
import sys
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder)
saved = load_file(folder + "/model.safetensors")
state = model.state_dict()
differ = [k for k, v in saved.items() if not (state[k].detach().numpy() == v).all()]
assert not differ, differ
print("python: transformers loaded the saved folder (%d tensors equal)" % len(saved))
PYEOF
      rc=$?
      [ "$rc" -eq 0 ] || [ "$rc" -eq 125 ] || fail "python: transformers could not load the saved folder: $(tail -2 "$OUT/finetune-load.log" | tr '\n' ' ')"
      echo "python finetune.py with a transformers model: $(grep -c "'loss'" "$OUT/finetune.log") log entries; $(tail -1 "$OUT/finetune-load.log")" >>"$OUT/tests.txt"
    else
      echo "python finetune.py (mt.Model: no transformers here): $(grep -c "'loss'" "$OUT/finetune.log") log entries" >>"$OUT/tests.txt"
    fi
  elif [ "$rc" -ne 125 ]; then
    fail "python: examples/finetune.py: $(tail -3 "$OUT/finetune.log" | tr '\n' ' ')"
  fi
fi

# ---- compute-sanitizer, with what time is left ----------------------------------------------------------
# memcheck on the kernels most likely to read out of bounds (attention blocks, the MoE sort and
# gather, the chunked cross-entropy), when the tool is there and a minute or more is left; skipped
# otherwise (not a failure: the tests above already ran these ops).
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
if [ -n "$sanitizer" ] && [ "$(budget 600)" -ge 60 ]; then
  say "compute-sanitizer memcheck"
  within 600 "$sanitizer" --tool memcheck --error-exitcode 3 "$B/megatrain_kernels_tests" \
    --gtest_filter='CudaOpsT/*.Attention*:CudaOpsT/*.Moe*:CudaOpsT/*.CrossEntropy*' >"$OUT/memcheck.log" 2>&1
  rc=$?
  echo "memcheck rc=$rc ($(grep -c '^========= Invalid' "$OUT/memcheck.log") invalid accesses)" >>"$OUT/tests.txt"
  [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || fail "compute-sanitizer memcheck (rc $rc): $(grep -m3 '^========= Invalid' "$OUT/memcheck.log" | tr '\n' ' ')"
else
  echo "memcheck not run (${sanitizer:-no compute-sanitizer}; $(budget 600) s left)" >>"$OUT/tests.txt"
fi
say "done in $(elapsed) s"
exit 0
