#!/usr/bin/env bash
# The GPU checks of the CUDA backend, on a machine with an NVIDIA GPU, in under 8 minutes:
#   1. the GPU tests (every op against the CPU backend, the Qwen3 q/k norm, the MoE block, gpt-oss's
#      sinks + sliding-window attention, yarn RoPE, clamped SwiGLU and stacked biased experts,
#      whole training steps of Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral and gpt-oss);
#   2. H2D/D2H bandwidth by size, each direction alone and both at once;
#   3. bf16 GEMM TFLOP/s at the layer shapes of a ~1B and a 7B model;
#   4. streamed training steps of a ~1B model (TinyLlama-1.1B's shape) and a 7B-shaped model
#      (Llama-2-7B's layers, 8 of its 32, so that its training state fits the machine's RAM), with
#      achieved TFLOP/s, MFU, the ratio to the GEMM rate, and the simulator's prediction.
# It prints a short table last. Build on the Debian machine first (scripts/build-gpu-bundle.sh),
# carry gpu-bundle/, and run from the repository root:
#   scripts/gpu-check.sh [bundle-dir]       (default gpu-bundle)
# Results go to $OUT (default /tmp/gpu-check): logs, JSON and the plans. Exit 0 when every check ran
# and every test passed.
set -uo pipefail
cd "$(dirname "$0")/.."
B=$(realpath "${1:-gpu-bundle}")
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export MEGATRAIN_PROFILES_DIR=$PWD/profiles
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
PY=python3
t0=$(date +%s)
say() { echo "[gpu-check $(($(date +%s) - t0))s] $*" >&2; }
failures=0
fail() { say "FAILED: $*"; failures=$((failures + 1)); }

# ---- 0. the machine and the bundle ------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi finds none); run it on the GPU machine" >&2
  exit 2
fi
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
say "GPU: $gpu; glibc $(ldd --version | head -1 | grep -o '[0-9.]*$'); $(nproc) cores"
for f in megatrain-exec megatrain-plan megatrain-bench-cuda megatrain_kernels_tests megatrain_executor_tests; do
  [ -x "$B/$f" ] || { echo "gpu-check: $B/$f is missing; build it with scripts/build-gpu-bundle.sh" >&2; exit 2; }
  if ldd "$B/$f" | grep -q "not found"; then
    echo "gpu-check: $f cannot load: $(ldd "$B/$f" | grep 'not found' | tr '\n' ' ')" >&2
    exit 2
  fi
done

# ---- 1. GPU tests -------------------------------------------------------------------------------
run_tests() {  # name, binary, filter
  local log="$OUT/tests-$1.log"
  timeout 240 "$2" --gtest_filter="$3" >"$log" 2>&1
  local rc=$?
  local passed failed skipped
  passed=$(grep -o '\[  PASSED  \] [0-9]* test' "$log" | grep -o '[0-9]*' || echo 0)
  failed=$(grep -c '^\[  FAILED  \] .*\.' "$log" || true)
  skipped=$(grep -c '^\[  SKIPPED \] .*\.' "$log" || true)
  echo "$1 passed=${passed:-0} failed=$failed skipped=$skipped rc=$rc" >>"$OUT/tests.txt"
  [ "$rc" -eq 0 ] || fail "tests $1 (rc $rc): $(grep '^\[  FAILED  \]' "$log" | head -5 | tr '\n' ' ')"
}
: >"$OUT/tests.txt"
say "GPU tests"
run_tests kernels "$B/megatrain_kernels_tests" '*'
run_tests executor "$B/megatrain_executor_tests" 'CudaTraining.*:CudaLayout.*:Backend*'
cat "$OUT/tests.txt" >&2
# Which cuBLAS path the MoE expert GEMMs took per type pair (cuda_ops_test's MoeBlockMatchesCpu).
grep -h 'grouped GEMMs' "$OUT/tests-kernels.log" 2>/dev/null | sed 's/^.* \(fp32\|bf16\): /\1 /' | sort -u >"$OUT/moe-gemm-path.txt" || true

# ---- 2. bandwidth ---------------------------------------------------------------------------------
say "H2D/D2H bandwidth"
timeout 90 "$B/megatrain-bench-cuda" bandwidth --json >"$OUT/bandwidth.json" 2>"$OUT/bandwidth.log" || fail "bandwidth"

# ---- 3. GEMMs at the layer shapes -------------------------------------------------------------------
say "bf16 GEMMs"
timeout 90 "$B/megatrain-bench-cuda" gemm --model llama-2-7b --seq 2048 --micro-batch 4 --json >"$OUT/gemm-7b.json" \
  2>"$OUT/gemm-7b.log" || fail "gemm 7b"
timeout 60 "$B/megatrain-bench-cuda" gemm --model tinyllama-1.1b --seq 2048 --micro-batch 8 --json >"$OUT/gemm-1b.json" \
  2>"$OUT/gemm-1b.log" || fail "gemm 1b"

# ---- 4. streamed training steps ----------------------------------------------------------------------
say "rig profile (quick)"
rig="$OUT/rig.json"
if ! timeout 120 "$B/megatrain-plan" profile --quick -o "$rig" >"$OUT/profile.log" 2>&1; then
  fail "profile --quick (the shipped h200-1.5tb profile is used for the predictions)"
  rig=h200-1.5tb
fi
$PY - "$OUT" <<'PYEOF'
import json, os, random, struct, sys
out = sys.argv[1]
cfg = json.load(open(os.path.join(os.environ["MEGATRAIN_PROFILES_DIR"], "models", "llama-2-7b.json")))
cfg["num_hidden_layers"] = 8  # Llama-2-7B's layer shapes; 8 of its 32 layers keep the state in RAM
json.dump(cfg, open(os.path.join(out, "llama-2-7b-8l.json"), "w"), indent=1)
rng = random.Random(1)
n = 1 << 22  # 4M tokens, more than the steps read
with open(os.path.join(out, "tokens.u16"), "wb") as f:
    f.write(struct.pack("<%dH" % n, *(rng.randrange(32000) for _ in range(n))))
PYEOF
: >"$OUT/runs.txt"
train() {  # label, model, tokens per step
  local label=$1 model=$2 tps=$3 plan="$OUT/plan-$1.json"
  say "plan $label"
  if ! timeout 60 "$B/megatrain-plan" plan -m "$model" -r "$rig" --seq 2048 --tokens-per-step "$tps" --steps 6 \
      -o "$plan" >"$OUT/plan-$label.log" 2>&1; then
    fail "plan $label: $(tail -2 "$OUT/plan-$label.log" | tr '\n' ' ')"
    return
  fi
  timeout 30 "$B/megatrain-plan" simulate "$plan" --json >"$OUT/sim-$label.json" 2>>"$OUT/plan-$label.log" || fail "simulate $label"
  say "train $label"
  timeout 240 "$B/megatrain-exec" "$plan" --data "$OUT/tokens.u16" --steps 6 --backend cuda \
    --trace "$OUT/measured-$label.mtrace" >"$OUT/exec-$label.log" 2>&1 || fail "exec $label: $(tail -3 "$OUT/exec-$label.log" | tr '\n' ' ')"
  echo "$label $plan $OUT/sim-$label.json $OUT/exec-$label.log" >>"$OUT/runs.txt"
}
train 1b tinyllama-1.1b 65536
train 7b-shaped "$OUT/llama-2-7b-8l.json" 65536

# ---- the table ---------------------------------------------------------------------------------------
say "done in $(($(date +%s) - t0)) s"
$PY - "$OUT" "$gpu" <<'PYEOF'
import json, os, re, statistics, sys
out, gpu = sys.argv[1], sys.argv[2]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception:
        return None
print()
print("## gpu-check: " + gpu)
print()
print("| check | result |")
print("|---|---|")
for line in open(os.path.join(out, "tests.txt")):
    print("| tests %s | %s |" % (line.split()[0], " ".join(line.split()[1:])))
if os.path.exists(os.path.join(out, "moe-gemm-path.txt")):
    for line in open(os.path.join(out, "moe-gemm-path.txt")):
        if line.strip():
            print("| MoE expert GEMMs | %s |" % line.strip().replace("|", "/"))
bw = load("bandwidth.json")
if bw and bw.get("sizes"):
    rows = bw["sizes"]
    best = lambda key: max(r.get(key) or 0 for r in rows)
    print("| H2D / D2H / both at once (best size) | %.1f / %.1f / %.1f GB/s (pinned %.1fx pageable) |" % (
        best("h2d_gbs"), best("d2h_gbs"), best("bidirectional_sum_gbs"), bw.get("pinned_over_pageable_h2d") or 0))
peak = {}
for tag in ("1b", "7b"):
    g = load("gemm-%s.json" % tag)
    if g and g.get("layer"):
        layer = g["layer"]["forward_backward_tflops"]
        peak[tag] = layer
        print("| bf16 GEMMs, %s layer shapes (%d tokens) | %.0f TFLOP/s; 8192^3: %.0f TFLOP/s |" % (
            g.get("model", tag), g.get("tokens", 0), layer, g["reference"]["tflops"]))
for line in open(os.path.join(out, "runs.txt")):
    label, plan, sim, log = line.split()
    s = load(os.path.basename(sim)) or {}
    text = open(log).read()
    tps = [float(m) for m in re.findall(r"step\s+\d+/\d+\s+loss\s+[-\d.naif]+\s+(\d+)\s+tokens/s", text)]
    loss = re.findall(r"loss\s+([-\d.]+)", text)
    if len(tps) < 3:
        print("| train %s | did not finish: %s |" % (label, text.strip().splitlines()[-1][:160] if text.strip() else "no output"))
        continue
    tokens = s.get("tokens_per_step")
    measured = statistics.median([tokens / t for t in tps[2:]]) if tokens else None
    flops = s.get("flops_per_step")
    achieved = flops / measured / 1e12 if flops and measured else None
    pred = s.get("step_time_s")
    ref = peak.get("1b" if label == "1b" else "7b")
    print("| train %s | step %.3f s measured (median of steps 3-6), %.3f s predicted (%+.1f%%); %.0f TFLOP/s, MFU %.1f%%%s; loss %s -> %s |" % (
        label, measured, pred or float("nan"), 100 * ((pred or 0) - measured) / measured, achieved or 0,
        100 * (achieved or 0) / 989.0, ", %.0f%% of the layer GEMM rate" % (100 * achieved / ref) if ref and achieved else "",
        loss[0] if loss else "?", loss[-1] if loss else "?"))
PYEOF
say "failures: $failures (logs and JSON in $OUT)"
[ "$failures" -eq 0 ]
