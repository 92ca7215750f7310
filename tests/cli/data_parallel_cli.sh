#!/usr/bin/env bash
# Data parallelism (docs/data-parallel.md) as a user runs it: `mpirun -np 2 megatrain-exec` on the
# CPU backend, two ranks on this machine over Open MPI's loopback, against one process on the same
# rows. Skips (77) where there is no mpirun or megatrain-exec was built without MPI.
set -uo pipefail
src=$2
# The project's Python (its venv, with numpy: scripts/python-env.sh), as ctest passes it.
py=${MEGATRAIN_PYTHON:-python3}
exe="$(dirname "$1")/megatrain-exec"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }
if ! command -v mpirun >/dev/null 2>&1; then
  echo "SKIP: no mpirun (scripts/setup.sh installs openmpi-bin and libopenmpi-dev)"
  exit 77
fi
# Open MPI refuses root unless told, and wants a slot per rank: this machine may have 2 cores or 1.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
mpi() { timeout 120 mpirun -np "$@"; }
head -c 40000 /usr/share/common-licenses/GPL-3 >"$tmp/text.txt" 2>/dev/null || yes "the quick brown fox jumps over the lazy dog" | head -c 40000 >"$tmp/text.txt"

# plan NAME RANKS MICRO_BATCH GRAD_ACCUM [python statements on d]: a variant of the tiny CPU plan.
plan() {
  $py - "$src/profiles/plans/tiny-cpu.json" "$tmp/$1.json" "$2" "$3" "$4" "${5:-pass}" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
ranks, d['training']['micro_batch'], d['training']['grad_accum'] = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if ranks > 1:
    d['parallel'] = {'data_parallel': ranks}
exec(sys.argv[6])
json.dump(d, open(sys.argv[2], 'w'))
PY
}
run1() { "$exe" "$tmp/$1.json" --data "$tmp/text.txt" --threads 1 "${@:2}"; }
run2() { mpi 2 "$exe" "$tmp/$1.json" --data "$tmp/text.txt" --threads 1 "${@:2}"; }

plan one 1 4 4
plan two 2 4 2
run2 two --steps 1 >"$tmp/probe.out" 2>"$tmp/probe.err"
if grep -q 'this build has no MPI' "$tmp/probe.err"; then
  echo "SKIP: megatrain-exec was built without MPI (MEGATRAIN_MPI=OFF)"
  exit 77
fi

# ---- the launch must be the plan's ----------------------------------------------------------
run1 two --steps 1 >"$tmp/out" 2>"$tmp/err"
check "a plan for 2 ranks started alone is refused before training, naming both counts" \
  "[ $? -ne 0 ] && grep -q 'plan is for 2 ranks' $tmp/err && grep -q 'this job has 1' $tmp/err && ! grep -q '^step' $tmp/out"
run2 one --steps 1 >"$tmp/out" 2>"$tmp/err"
check "a plan for 1 rank started by mpirun -np 2 is refused by both ranks" \
  "[ $? -ne 0 ] && grep -q 'plan is for 1 rank ' $tmp/err && grep -q 'this job has 2' $tmp/err && ! grep -q '^step' $tmp/out"
plan pernode 2 4 2 "d['parallel']['ranks_per_node'] = 1"
run2 pernode --steps 1 >"$tmp/out" 2>"$tmp/err"
check "a plan with 1 rank per node started as 2 ranks on one node is refused" \
  "[ $? -ne 0 ] && grep -q 'ranks_per_node' $tmp/err && ! grep -q '^step' $tmp/out"

# ---- the ranks agree before training (issue 49) ------------------------------------------------
# Each rank gets its own command line (mpirun's MPMD form, as nodes with their own copies of the files
# would): a difference is refused by every rank before any state is made, naming the key and rank.
plan twob 2 4 2 "d['model'] = 'tiny-qwen2'"
plan twolr 2 4 2 "d['training']['lr'] = 2e-3"
plan twoseed 2 4 2 "d['training']['seed'] = 7"
head -c 40000 /usr/share/common-licenses/GPL-2 >"$tmp/text2.txt" 2>/dev/null || yes "a different text entirely" | head -c 40000 >"$tmp/text2.txt"
mpmd() {  # mpmd PLAN_A PLAN_B [args of rank 1...]: rank 0 runs PLAN_A on text.txt with --steps 1
  timeout 120 mpirun -np 1 "$exe" "$tmp/$1.json" --data "$tmp/text.txt" --threads 1 --steps 1 : \
    -np 1 "$exe" "$tmp/$2.json" --threads 1 "${@:3}"
}
agree_check() {  # agree_check WHAT KEY: both ranks refuse, naming KEY and rank 1; nothing trains
  check "$1" "[ $? -ne 0 ] && [ \$(grep -c 'do not agree on the $2' $tmp/err) -ge 2 ] && grep -q 'rank 1 has' $tmp/err && ! grep -q '^step' $tmp/out"
}
mpmd two twob --data "$tmp/text.txt" --steps 1 >"$tmp/out" 2>"$tmp/err"
agree_check "ranks with different models are refused by both before training (was: malloc(): corrupted top size)" "model config"
mpmd two two --data "$tmp/text2.txt" --steps 1 >"$tmp/out" 2>"$tmp/err"
agree_check "ranks with different data files are refused (trained before)" "data"
mpmd two twolr --data "$tmp/text.txt" --steps 1 >"$tmp/out" 2>"$tmp/err"
agree_check "ranks with different learning rates are refused (trained before)" "plan"
mpmd two twoseed --data "$tmp/text.txt" --steps 1 >"$tmp/out" 2>"$tmp/err"
agree_check "ranks with different seeds are refused" "plan"
mpmd two two --data "$tmp/text.txt" --steps 2 >"$tmp/out" 2>"$tmp/err"
agree_check "ranks with different --steps are refused, naming both counts" "--steps"
grep -q 'rank 0 has 1, rank 1 has 2' "$tmp/err" || { echo "FAIL: the --steps message gives both counts"; fails=$((fails + 1)); }
mpmd two two --data "$tmp/text.txt" --steps 1 --skip-nonfinite-steps >"$tmp/out" 2>"$tmp/err"
agree_check "ranks with different run options are refused" "run options"
mpi 2 "$exe" "$tmp/two.json" --data "$tmp/text.txt" --threads 1 --steps 1 --checkpoint-dir "$tmp/agree1" >/dev/null 2>&1
mpi 2 "$exe" "$tmp/two.json" --data "$tmp/text.txt" --threads 1 --steps 2 --checkpoint-dir "$tmp/agree2" >/dev/null 2>&1
timeout 120 mpirun -np 1 "$exe" "$tmp/two.json" --data "$tmp/text.txt" --threads 1 --steps 3 --checkpoint-dir "$tmp/agree1" --resume : \
  -np 1 "$exe" "$tmp/two.json" --data "$tmp/text.txt" --threads 1 --steps 3 --checkpoint-dir "$tmp/agree2" --resume >"$tmp/out" 2>"$tmp/err"
agree_check "ranks resuming from different checkpoints (nodes with their own folders) are refused" "resume step"
grep -q 'rank 0 has 1, rank 1 has 2' "$tmp/err" || { echo "FAIL: the resume message gives both steps"; fails=$((fails + 1)); }
mpmd two two --data "$tmp/text.txt" --steps 1 >"$tmp/out" 2>"$tmp/err"
check "ranks that agree train" "[ $? -eq 0 ] && grep -q '^step' $tmp/out"

# parallel.collective nccl sums between GPUs: the CPU backend has none and refuses it by name, unless
# its test stand-in is asked for (below); scripts/gpu-check.sh runs NCCL itself.
plan nccl 2 4 2 "d['parallel']['collective'] = 'nccl'"
run2 nccl --steps 1 >"$tmp/out" 2>"$tmp/err"
check "collective nccl on the CPU backend is refused before training, naming what is accepted" \
  "[ $? -ne 0 ] && grep -q 'parallel.collective nccl sums the gradients between GPUs' $tmp/err && grep -q 'accepted here: parallel.collective mpi' $tmp/err && ! grep -q '^step' $tmp/out"
"$(dirname "$1")/megatrain-plan" simulate "$tmp/nccl.json" >"$tmp/out" 2>"$tmp/err"
check "simulate refuses collective nccl on the CPU backend's rig as megatrain-exec does" \
  "[ $? -ne 0 ] && grep -q 'parallel.collective nccl sums the gradients between GPUs, and rig' $tmp/out $tmp/err"

# ---- 2 ranks x grad_accum 2 against 1 process x grad_accum 4 on the same rows -------------------
# The rows are the same but not their grouping: rank k's micro-batch j holds rows 2i + k, the one
# process's holds rows 4j .. 4j + 3, so the fp32 sums run in another order. The bound is measured,
# not chosen: regrouping the same rows into micro-batches of 1, 2, 8 and 16 in one process moves
# the weights by some amount; 2 ranks must stay within twice the largest such move, and their
# losses within 1e-6 relative.
compare=$(cat <<'PY'
import json, struct, sys
import numpy as np
def tensors(path):
    b = open(path, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    head = json.loads(b[8:8 + n])
    out = {}
    for k, v in head.items():
        if k == '__metadata__' or v['dtype'] != 'F32':
            continue
        s, e = v['data_offsets']
        out[k] = np.frombuffer(b[8 + n + s:8 + n + e], dtype=np.float32).astype(np.float64)
    return out
def diff(a, b):  # the largest difference of any tensor, relative to that tensor's largest value
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    return max(np.abs(ta[k] - tb[k]).max() / max(np.abs(ta[k]).max(), 1e-30) for k in ta)
def losses(d):
    return json.load(open(d + '/manifest.json'))['losses']['values']
PY
)
# equal NAME ONE_DIR TWO_DIR REGROUPED_DIRS...: the step-6 checkpoints of one process and 2 ranks.
equal() {
  $py - "$@" <<PY
$compare
name, one, two, regrouped = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
step = '/step-00000006'
l1, l2 = losses(one + step), losses(two + step)
loss_rel = max(abs(a - b) / abs(a) for a, b in zip(l1, l2))
noise = max(diff(one + step + '/model.safetensors', r + step + '/model.safetensors') for r in regrouped)
w = diff(one + step + '/model.safetensors', two + step + '/model.safetensors')
m = diff(one + step + '/optimizer.safetensors', two + step + '/optimizer.safetensors')
print(f'{name}: losses rel {loss_rel:.2e}, weights {w:.2e}, optimizer states {m:.2e}, regrouping moves the weights up to {noise:.2e}')
assert len(l1) == len(l2) == 6
assert loss_rel <= 1e-6, loss_rel
assert 0 < noise and w <= 2 * noise, (w, noise)
PY
}
# variant NAME EXTRA_PYTHON [exec flags]: one process, its regroupings and 2 ranks, 6 steps each.
variant() {
  local name=$1 extra=$2
  shift 2
  plan "$name-1" 1 4 4 "$extra"
  plan "$name-2" 2 4 2 "$extra"
  local groups=()
  for mb in 1 2 8 16; do
    plan "$name-mb$mb" 1 $mb $((16 / mb)) "$extra"
    run1 "$name-mb$mb" --steps 6 --checkpoint-dir "$tmp/$name-mb$mb.ck" "$@" >/dev/null 2>"$tmp/err" || cat "$tmp/err"
    groups+=("$tmp/$name-mb$mb.ck")
  done
  run1 "$name-1" --steps 6 --checkpoint-dir "$tmp/$name-1.ck" "$@" >"$tmp/$name-1.out" 2>"$tmp/err" || cat "$tmp/err"
  run2 "$name-2" --steps 6 --checkpoint-dir "$tmp/$name-2.ck" "$@" >"$tmp/$name-2.out" 2>"$tmp/err" || cat "$tmp/err"
  check "$name: 2 ranks x 2 micro-batches train as 1 process x 4 on the same rows" \
    "equal $name $tmp/$name-1.ck $tmp/$name-2.ck ${groups[*]}"
}
variant clipped "pass"
check "the 2-rank run says so once, with the rows each rank trains and the whole step's tokens" \
  "[ \$(grep -c 'data parallel: MPI' $tmp/clipped-2.out) -eq 1 ] && grep -q 'each rank trains 8 of every 16 rows' $tmp/clipped-2.out && grep -q '2048 tokens/step' $tmp/clipped-2.out && [ \$(grep -c '^step' $tmp/clipped-2.out) -eq 6 ]"
variant unclipped "d['training']['clip_grad_norm'] = 0"
variant microbatch-major "d['schedule']['order'] = 'microbatch-major'"
variant in-memory "pass" --in-memory
# Mixture-of-Experts (tiny Mixtral, the load-balancing loss reported, not trained): an expert that
# any rank's tokens chose is updated on every rank. (With the load-balancing loss in the objective,
# Hugging Face's loss is per micro-batch, so grouping the rows otherwise changes the objective
# itself, not only the order of the sums: no one-process run is the reference then.)
variant moe "d['model'] = 'tiny-mixtral'"
mkdir -p "$tmp/nvme"
variant nvme-q8 "d['precision']['transfer'] = 'bf16'; d['placement'].update(master_weights='nvme', optimizer_states='nvme', nvme_dirs=['$tmp/nvme'], pinned_staging_bytes=4 << 20); d['optimizer'].update(m_format='q8', v_format='q8')"
check "on the NVMe tier each rank keeps its state in its own folder" "[ -d $tmp/nvme/rank-0 ] && [ -d $tmp/nvme/rank-1 ]"

# ---- checkpoints: resumed on 2 ranks bit for bit, and across rank counts ------------------------
run2 clipped-2 --steps 3 --checkpoint-dir "$tmp/r2" >/dev/null 2>"$tmp/err"
run2 clipped-2 --steps 6 --checkpoint-dir "$tmp/r2" --resume >"$tmp/out" 2>"$tmp/err"
check "a 2-rank run stopped at step 3 and resumed on 2 ranks equals the uninterrupted one bit for bit" \
  "[ $? -eq 0 ] && grep -q 'resuming from' $tmp/out && cmp -s $tmp/r2/step-00000006/model.safetensors $tmp/clipped-2.ck/step-00000006/model.safetensors && cmp -s $tmp/r2/step-00000006/optimizer.safetensors $tmp/clipped-2.ck/step-00000006/optimizer.safetensors"
mkdir -p "$tmp/r21" && cp -r "$tmp/r2/step-00000003" "$tmp/r21/"
run1 clipped-1 --steps 6 --checkpoint-dir "$tmp/r21" --resume >"$tmp/out" 2>"$tmp/err"
check "a 2-rank checkpoint resumes in 1 process (grad_accum 4) and goes on as the 2-rank run does" \
  "[ $? -eq 0 ] && equal resumed-on-1 $tmp/r21 $tmp/clipped-2.ck $tmp/clipped-mb1.ck $tmp/clipped-mb2.ck $tmp/clipped-mb8.ck $tmp/clipped-mb16.ck"
run1 clipped-1 --steps 3 --checkpoint-dir "$tmp/r12" >/dev/null 2>"$tmp/err"
run2 clipped-2 --steps 6 --checkpoint-dir "$tmp/r12" --resume >"$tmp/out" 2>"$tmp/err"
check "a 1-process checkpoint resumes on 2 ranks and goes on as the 1-process run does" \
  "[ $? -eq 0 ] && equal resumed-on-2 $tmp/clipped-1.ck $tmp/r12 $tmp/clipped-mb1.ck $tmp/clipped-mb2.ck $tmp/clipped-mb8.ck $tmp/clipped-mb16.ck"
plan two-accum3 2 4 3
run2 two-accum3 --steps 6 --checkpoint-dir "$tmp/r2" --resume >"$tmp/out" 2>"$tmp/err"
check "a resume with another global batch (2 x 3 micro-batches) is refused, naming grad_accum x data_parallel" \
  "[ $? -ne 0 ] && grep -q 'grad_accum x parallel.data_parallel' $tmp/err"

# ---- sharded optimizer states (ZeRO) -------------------------------------------------------------
# With parallel.host_state sharded each rank keeps and updates the moments of its own tensors, and
# the ranks gather the new weights. With 2 ranks every summed element is a + b either way, so the
# sharded run must equal the replicated one bit for bit: the weights, and every moment entry of the
# optimizer shards taken together.
same_moments=$(cat <<'PY'
import glob, json, struct, sys
def entries(path):
    b = open(path, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    head = json.loads(b[8:8 + n])
    return {k: b[8 + n + v['data_offsets'][0]:8 + n + v['data_offsets'][1]] for k, v in head.items() if k != '__metadata__'}
def moments(d):  # the entries of optimizer.safetensors, or of the shards together (each in one)
    out, sizes = {}, []
    for f in sorted(glob.glob(d + '/optimizer*.safetensors')):
        e = entries(f)
        assert not (e.keys() & out.keys()), f
        out.update(e)
        sizes.append(sum(len(v) for v in e.values()))
    return out, sizes
(a, _), (b, sizes) = moments(sys.argv[1]), moments(sys.argv[2])
assert a.keys() == b.keys(), (len(a), len(b))
bad = [k for k in a if a[k] != b[k]]
print(f'{len(a)} moment entries, {len(bad)} differ; shard bytes {sizes}')
assert not bad, bad[:3]
if len(sizes) > 1:  # each rank's share is about half (whole tensors, balanced by size)
    assert max(sizes) < 0.75 * sum(sizes), sizes
PY
)
# sharded NAME EXTRA_PYTHON [exec flags]: replicated and sharded on 2 ranks, 10 steps each.
sharded() {
  local name=$1 extra=$2
  shift 2
  plan "$name-rep" 2 4 2 "$extra"
  plan "$name-shard" 2 4 2 "$extra; d['parallel']['host_state'] = 'sharded'"
  run2 "$name-rep" --steps 10 --checkpoint-dir "$tmp/$name-rep.ck" "$@" >/dev/null 2>"$tmp/err" || cat "$tmp/err"
  run2 "$name-shard" --steps 10 --checkpoint-dir "$tmp/$name-shard.ck" "$@" >"$tmp/$name-shard.out" 2>"$tmp/err" || cat "$tmp/err"
  check "sharded $name: weights and optimizer states after 10 steps equal the replicated run's bit for bit" \
    "cmp -s $tmp/$name-rep.ck/step-00000010/model.safetensors $tmp/$name-shard.ck/step-00000010/model.safetensors && [ -f $tmp/$name-shard.ck/step-00000010/optimizer-00001-of-00002.safetensors ] && $py -c \"\$same_moments\" $tmp/$name-rep.ck/step-00000010 $tmp/$name-shard.ck/step-00000010"
}
sharded fp32 "pass"
check "the sharded run says how the states are split" "grep -q 'optimizer states sharded over the ranks: .*rank 0 keeps [0-9]* of the [0-9]* tensors' $tmp/fp32-shard.out"
sharded unclipped "d['training']['clip_grad_norm'] = 0"
sharded in-memory "pass" --in-memory
sharded bf16-states "d['optimizer'].update(m_format='bf16', v_format='bf16')"
sharded q4 "d['optimizer'].update(m_format='q4', v_format='q4')"
sharded q3-q2 "d['optimizer'].update(m_format='q3', v_format='q2')"
sharded moe "d['model'] = 'tiny-mixtral'"
mkdir -p "$tmp/nvme-shard"
sharded nvme-q8 "d['precision']['transfer'] = 'bf16'; d['placement'].update(master_weights='nvme', optimizer_states='nvme', nvme_dirs=['$tmp/nvme-shard'], pinned_staging_bytes=4 << 20); d['optimizer'].update(m_format='q8', v_format='q8')"
sharded compressed "pass" --checkpoint-compress

# Sharded checkpoints: stopped and resumed on 2 sharded ranks bit for bit; resumed with replicated
# states, and in one process, exactly as from the replicated checkpoint of the same step.
run2 fp32-shard --steps 4 --checkpoint-dir "$tmp/s2" >/dev/null 2>"$tmp/err"
run2 fp32-shard --steps 10 --checkpoint-dir "$tmp/s2" --resume >"$tmp/out" 2>"$tmp/err"
check "a sharded run stopped at step 4 and resumed sharded equals the uninterrupted one bit for bit" \
  "[ $? -eq 0 ] && grep -q 'resuming from' $tmp/out && ( for f in model.safetensors optimizer-00000-of-00002.safetensors optimizer-00001-of-00002.safetensors; do cmp -s $tmp/s2/step-00000010/\$f $tmp/fp32-shard.ck/step-00000010/\$f || exit 1; done )"
for v in q4 nvme-q8; do
  run2 $v-shard --steps 4 --checkpoint-dir "$tmp/s2-$v" >/dev/null 2>"$tmp/err"
  run2 $v-shard --steps 10 --checkpoint-dir "$tmp/s2-$v" --resume >"$tmp/out" 2>"$tmp/err"
  check "sharded $v: stopped at step 4 and resumed sharded, every file equals the uninterrupted run's" \
    "[ $? -eq 0 ] && grep -q 'resuming from' $tmp/out && ( for f in model.safetensors optimizer-00000-of-00002.safetensors optimizer-00001-of-00002.safetensors; do cmp -s $tmp/s2-$v/step-00000010/\$f $tmp/$v-shard.ck/step-00000010/\$f || exit 1; done )"
done
mkdir -p "$tmp/s2r" && cp -r "$tmp/s2/step-00000004" "$tmp/s2r/"
run2 fp32-rep --steps 10 --checkpoint-dir "$tmp/s2r" --resume >"$tmp/out" 2>"$tmp/err"
check "a sharded checkpoint resumed on 2 replicated ranks goes on bit for bit as the sharded run" \
  "[ $? -eq 0 ] && cmp -s $tmp/s2r/step-00000010/model.safetensors $tmp/fp32-shard.ck/step-00000010/model.safetensors"
run2 fp32-rep --steps 4 --checkpoint-dir "$tmp/r2s" >/dev/null 2>"$tmp/err"
run2 fp32-shard --steps 10 --checkpoint-dir "$tmp/r2s" --resume >"$tmp/out" 2>"$tmp/err"
check "a replicated checkpoint resumed on 2 sharded ranks goes on bit for bit as the replicated run" \
  "[ $? -eq 0 ] && cmp -s $tmp/r2s/step-00000010/model.safetensors $tmp/fp32-rep.ck/step-00000010/model.safetensors"
mkdir -p "$tmp/s21" "$tmp/r21b" && cp -r "$tmp/s2/step-00000004" "$tmp/s21/" && cp -r "$tmp/r2s/step-00000004" "$tmp/r21b/"
run1 clipped-1 --steps 6 --checkpoint-dir "$tmp/s21" --resume >"$tmp/out" 2>"$tmp/err" && \
  run1 clipped-1 --steps 6 --checkpoint-dir "$tmp/r21b" --resume >/dev/null 2>>"$tmp/err"
check "a sharded checkpoint resumes in 1 process exactly as the replicated checkpoint of the same step does" \
  "[ $? -eq 0 ] && grep -q 'resuming from' $tmp/out && cmp -s $tmp/s21/step-00000006/model.safetensors $tmp/r21b/step-00000006/model.safetensors && $py -c \"\$same_moments\" $tmp/r21b/step-00000006 $tmp/s21/step-00000006"
mkdir -p "$tmp/s2bad" && cp -r "$tmp/s2/step-00000004" "$tmp/s2bad/" && rm "$tmp/s2bad/step-00000004/optimizer-00001-of-00002.safetensors"
run2 fp32-shard --steps 10 --checkpoint-dir "$tmp/s2bad" --resume >"$tmp/out" 2>"$tmp/err"
check "a sharded checkpoint missing a shard is refused, naming the file" \
  "[ $? -ne 0 ] && grep -q 'optimizer-00001-of-00002.safetensors.* is missing' $tmp/err"

# ---- one host state per node (parallel.host_state shared) ----------------------------------------
# The node's ranks map one copy of the master weights, streaming copy and summed gradients; each
# sums its own tensors' gradients into it, keeps their moments and updates them in place. With 2
# ranks the sums are a + b as in the replicated run, so the runs must agree bit for bit.
shared() {
  local name=$1 extra=$2
  shift 2
  [ -d "$tmp/$name-rep.ck" ] || { plan "$name-rep" 2 4 2 "$extra"; run2 "$name-rep" --steps 10 --checkpoint-dir "$tmp/$name-rep.ck" "$@" >/dev/null 2>"$tmp/err" || cat "$tmp/err"; }
  plan "$name-shared" 2 4 2 "$extra; d['parallel']['host_state'] = 'shared'"
  run2 "$name-shared" --steps 10 --checkpoint-dir "$tmp/$name-shared.ck" "$@" >"$tmp/$name-shared.out" 2>"$tmp/err" || cat "$tmp/err"
  check "shared $name: weights and optimizer states after 10 steps equal the replicated run's bit for bit" \
    "cmp -s $tmp/$name-rep.ck/step-00000010/model.safetensors $tmp/$name-shared.ck/step-00000010/model.safetensors && [ -f $tmp/$name-shared.ck/step-00000010/optimizer-00001-of-00002.safetensors ] && $py -c \"\$same_moments\" $tmp/$name-rep.ck/step-00000010 $tmp/$name-shared.ck/step-00000010"
}
shmbefore=$(ls /dev/shm 2>/dev/null | grep -c '^megatrain-')
shared fp32 "pass"
check "the shared run says what the node shares and how the moments are split" \
  "grep -q 'host state shared by each node.s 2 ranks: .* in /dev/shm.*rank 0 keeps [0-9]* of the [0-9]* tensors' $tmp/fp32-shared.out"
check "nothing is left in /dev/shm after the shared runs" "[ \$(ls /dev/shm 2>/dev/null | grep -c '^megatrain-') -eq $shmbefore ]"
shared unclipped "d['training']['clip_grad_norm'] = 0"
shared microbatch-major "d['schedule']['order'] = 'microbatch-major'"
shared in-memory "pass" --in-memory
shared q4 "d['optimizer'].update(m_format='q4', v_format='q4')"
shared q3-q2 "d['optimizer'].update(m_format='q3', v_format='q2')"
shared moe "d['model'] = 'tiny-mixtral'"
mkdir -p "$tmp/nvme-bf16"
shared bf16-nvme-states "d['precision']['transfer'] = 'bf16'; d['placement'].update(optimizer_states='nvme', nvme_dirs=['$tmp/nvme-bf16'], pinned_staging_bytes=4 << 20); d['optimizer'].update(m_format='q8', v_format='q8')"
run2 fp32-shared --steps 4 --checkpoint-dir "$tmp/h2" >/dev/null 2>"$tmp/err"
run2 fp32-shared --steps 10 --checkpoint-dir "$tmp/h2" --resume >"$tmp/out" 2>"$tmp/err"
check "a shared run stopped at step 4 and resumed shared equals the uninterrupted one bit for bit" \
  "[ $? -eq 0 ] && grep -q 'resuming from' $tmp/out && ( for f in model.safetensors optimizer-00000-of-00002.safetensors optimizer-00001-of-00002.safetensors; do cmp -s $tmp/h2/step-00000010/\$f $tmp/fp32-shared.ck/step-00000010/\$f || exit 1; done )"
mkdir -p "$tmp/h2r" && cp -r "$tmp/h2/step-00000004" "$tmp/h2r/"
run2 fp32-rep --steps 10 --checkpoint-dir "$tmp/h2r" --resume >"$tmp/out" 2>"$tmp/err"
check "a shared checkpoint resumed on 2 replicated ranks goes on bit for bit" \
  "[ $? -eq 0 ] && cmp -s $tmp/h2r/step-00000010/model.safetensors $tmp/fp32-rep.ck/step-00000010/model.safetensors"
plan nvme-master-shared 2 4 2 "d['precision']['transfer'] = 'bf16'; d['placement'].update(master_weights='nvme', nvme_dirs=['$tmp'], pinned_staging_bytes=4 << 20); d['parallel']['host_state'] = 'shared'"
run2 nvme-master-shared --steps 1 >"$tmp/out" 2>"$tmp/err"
check "a shared host state with master weights on NVMe is refused, naming both fields" \
  "[ $? -ne 0 ] && grep -q 'host_state shared.*master_weights' $tmp/err && ! grep -q '^step' $tmp/out"
MEGATRAIN_SHM_DIR=$tmp/no-such-folder mpi 2 -x MEGATRAIN_SHM_DIR "$exe" "$tmp/fp32-shared.json" --data "$tmp/text.txt" --threads 1 --steps 1 >"$tmp/out" 2>"$tmp/err"
check "a shared-memory folder that cannot be used is an error naming it, before training" \
  "[ $? -ne 0 ] && grep -q \"cannot make the node's shared training state '$tmp/no-such-folder/megatrain-\" $tmp/err && ! grep -q '^step' $tmp/out"
# 4 ranks as 2 nodes of 2 (MEGATRAIN_TEST_RANKS_PER_NODE groups this machine's ranks into nodes, each
# with its own shared memory): each node's owners add up their node's gradients, then the owners of
# the same range on both nodes add up the nodes' sums, which is another order than the 4-rank
# replicated sum (a+b)+(c+d) against its reduce-scatter's; the weights then differ in the last bits
# (1.9e-7 of each tensor's largest value measured here, after 10 steps), bounded at 1e-6. Each save
# checks that the two nodes' copies of the weights are equal bit for bit.
plan four-rep 4 4 1 "d['parallel']['ranks_per_node'] = 2"
plan four-shared 4 4 1 "d['parallel'].update(ranks_per_node=2, host_state='shared')"
for v in rep shared; do
  MEGATRAIN_TEST_RANKS_PER_NODE=2 mpi 4 -x MEGATRAIN_TEST_RANKS_PER_NODE "$exe" "$tmp/four-$v.json" --data "$tmp/text.txt" --threads 1 \
    --steps 10 --checkpoint-every 5 --checkpoint-dir "$tmp/four-$v.ck" >"$tmp/four-$v.out" 2>"$tmp/err" || cat "$tmp/err"
done
# near WHAT A B: two runs' weights (safetensors files) within 1e-6 of each tensor's largest value.
near=$(cat <<'PY'
import json, struct, sys
import numpy as np
def load(p):
    b = open(p, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    h = json.loads(b[8:8 + n])
    return {k: np.frombuffer(b[8 + n + v['data_offsets'][0]:8 + n + v['data_offsets'][1]], dtype=np.float32) for k, v in h.items() if k != '__metadata__'}
a, b = load(sys.argv[2]), load(sys.argv[3])
worst = max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(a[k]))) for k in a)
print(f'{sys.argv[1]}: largest difference {worst:.3g} of a tensor largest value')
assert worst < 1e-6, worst
PY
)
check "4 ranks on 2 emulated nodes with shared host states: weights within 1e-6 of the replicated run, both nodes' copies equal at every save" \
  "grep -q '4 ranks on 2 nodes' $tmp/four-shared.out && [ -f $tmp/four-shared.ck/step-00000005/model.safetensors ] && $py -c \"\$near\" '4 ranks, 2 nodes, shared vs replicated' $tmp/four-rep.ck/step-00000010/model.safetensors $tmp/four-shared.ck/step-00000010/model.safetensors"

# ---- the NCCL path without GPUs (MEGATRAIN_CPU_DEVICE_SUMS=mpi) -----------------------------------
# parallel.collective nccl sums each unit's gradient on the devices before its copy to the host; with
# sharded or shared states each rank then copies only its own range of the sum (into the node's
# memory when shared, keeping no gradient of its own). The CPU backend's test stand-in sums its
# "device" gradients over MPI, so the trainer's NCCL path runs on this machine's ranks. With 2 ranks
# every sum is a + b as on the host, so each run must equal the MPI run of its host state bit for bit.
nccl_run() {  # RANKS PLAN [flags]; $nodes_env: more mpirun -x options
  local n=$1
  shift
  MEGATRAIN_CPU_DEVICE_SUMS=mpi mpi "$n" -x MEGATRAIN_CPU_DEVICE_SUMS ${nodes_env:-} "$exe" "$@" --data "$tmp/text.txt" --threads 1
}
# nccl_train NAME EXTRA_PYTHON: 10 steps with collective nccl on 2 ranks, checkpoints in nccl-NAME.ck.
nccl_train() {
  plan "nccl-$1" 2 4 2 "$2; d['parallel']['collective'] = 'nccl'"
  nccl_run 2 "$tmp/nccl-$1.json" --steps 10 --checkpoint-dir "$tmp/nccl-$1.ck" >"$tmp/nccl-$1.out" 2>"$tmp/err" || cat "$tmp/err"
}
# nccl_same NAME REFERENCE_CHECKPOINTS EXTRA_PYTHON: that run equals the reference bit for bit.
nccl_same() {
  local name=$1 ref=$2
  nccl_train "$name" "$3"
  check "nccl $name: gradients summed before their copy train bit for bit as the MPI run" \
    "grep -q 'stand-in for NCCL' $tmp/nccl-$name.out && cmp -s $ref/step-00000010/model.safetensors $tmp/nccl-$name.ck/step-00000010/model.safetensors && $py -c \"\$same_moments\" $ref/step-00000010 $tmp/nccl-$name.ck/step-00000010"
}
nccl_same replicated "$tmp/fp32-rep.ck" "pass"
nccl_same sharded "$tmp/fp32-shard.ck" "d['parallel']['host_state'] = 'sharded'"
nccl_same sharded-q4 "$tmp/q4-shard.ck" "d['optimizer'].update(m_format='q4', v_format='q4'); d['parallel']['host_state'] = 'sharded'"
nccl_same shared "$tmp/fp32-shared.ck" "d['parallel']['host_state'] = 'shared'"
nccl_same shared-unclipped "$tmp/unclipped-shared.ck" "d['training']['clip_grad_norm'] = 0; d['parallel']['host_state'] = 'shared'"
nccl_same shared-moe "$tmp/moe-shared.ck" "d['model'] = 'tiny-mixtral'; d['parallel']['host_state'] = 'shared'"
nccl_same shared-bf16-nvme-states "$tmp/bf16-nvme-states-shared.ck" "d['precision']['transfer'] = 'bf16'; d['placement'].update(optimizer_states='nvme', nvme_dirs=['$tmp/nvme-bf16'], pinned_staging_bytes=4 << 20); d['optimizer'].update(m_format='q8', v_format='q8'); d['parallel']['host_state'] = 'shared'"
# Microbatch-major: each round's gradient is summed before it is added on the host, another order
# than the host sum of the accumulated gradients: replicated within 1e-6 of MPI's, shared bit for bit
# as replicated with NCCL.
nccl_train mbm-replicated "d['schedule']['order'] = 'microbatch-major'"
check "nccl microbatch-major: within 1e-6 of the MPI run" \
  "$py -c \"\$near\" 'nccl vs mpi, microbatch-major' $tmp/microbatch-major-rep.ck/step-00000010/model.safetensors $tmp/nccl-mbm-replicated.ck/step-00000010/model.safetensors"
nccl_same mbm-shared "$tmp/nccl-mbm-replicated.ck" "d['schedule']['order'] = 'microbatch-major'; d['parallel']['host_state'] = 'shared'"
# 4 ranks as 2 emulated nodes: NCCL sums over all 4 ranks, each node's owners copy their ranges into
# their node's memory; the same sums as 4 replicated ranks with NCCL, so equal bit for bit.
for v in rep shared; do
  plan "four-nccl-$v" 4 4 1 "d['parallel'].update(ranks_per_node=2, collective='nccl', host_state='${v/rep/replicated}')"
  MEGATRAIN_TEST_RANKS_PER_NODE=2 nodes_env="-x MEGATRAIN_TEST_RANKS_PER_NODE" nccl_run 4 "$tmp/four-nccl-$v.json" --steps 6 --checkpoint-dir "$tmp/four-nccl-$v.ck" >"$tmp/four-nccl-$v.out" 2>"$tmp/err" || cat "$tmp/err"
done
check "nccl, 4 ranks on 2 emulated nodes: shared host states train bit for bit as replicated ones" \
  "grep -q '4 ranks on 2 nodes' $tmp/four-nccl-shared.out && cmp -s $tmp/four-nccl-rep.ck/step-00000006/model.safetensors $tmp/four-nccl-shared.ck/step-00000006/model.safetensors"
# What each rank copies: with shared states, its own range of every gradient; the two ranks' copies
# of a unit add up to the unit's whole gradient, which the MPI run copies on each rank.
run2 fp32-shared --steps 1 --trace "$tmp/whole.mtrace" >/dev/null 2>"$tmp/err"
nccl_run 2 "$tmp/nccl-shared.json" --steps 1 --trace "$tmp/share.mtrace" >/dev/null 2>"$tmp/err"
check "nccl with a shared state: each rank copies its range of each gradient, the ranges adding up to the whole" \
  "[ $? -eq 0 ] && $py - $tmp/whole.mtrace $tmp/share.mtrace $tmp/share.rank1.mtrace <<'PY'
import sqlite3, sys
def copies(path):
    return dict(sqlite3.connect(path).execute(\"select layer, sum(bytes) from spans where kind = 'd2h' group by layer\").fetchall())
whole, r0, r1 = (copies(p) for p in sys.argv[1:])
assert set(whole) == set(r0) == set(r1) and len(whole) > 2, (whole, r0, r1)
for u in whole:
    assert r0[u] + r1[u] == whole[u], (u, r0[u], r1[u], whole[u])
assert sum(r0.values()) < 0.75 * sum(whole.values()) and sum(r1.values()) < 0.75 * sum(whole.values()), (r0, r1, whole)
print('copied per rank:', sum(r0.values()), sum(r1.values()), 'of', sum(whole.values()))
PY"

# ---- traces: one per rank ------------------------------------------------------------------------
run2 clipped-2 --steps 4 --trace "$tmp/dp.mtrace" >"$tmp/out" 2>"$tmp/err"
check "each rank writes its trace (rank 1's beside rank 0's), with every step" "[ $? -eq 0 ] && $py - $tmp/dp.mtrace $tmp/dp.rank1.mtrace <<'PY'
import sqlite3, sys
for path in sys.argv[1:]:
    db = sqlite3.connect(path)
    assert db.execute('select count(*) from steps').fetchone()[0] == 4, path
PY"

run2 fp32-shard --steps 2 --trace "$tmp/shard.mtrace" >"$tmp/out" 2>"$tmp/err"
check "with sharded states each rank's trace shows every unit's weight gather on the optimizer lane, after its update" \
  "[ $? -eq 0 ] && $py - $tmp/shard.mtrace $tmp/shard.rank1.mtrace <<'PY'
import sqlite3, sys
for path in sys.argv[1:]:
    db = sqlite3.connect(path)
    rows = db.execute(\"select l.name, s.step, s.layer, s.start_ns, s.bytes from spans s join lanes l on s.lane = l.id where s.kind = 'weight_gather'\").fetchall()
    adam = {(r[0], r[1]): r[2] for r in db.execute(\"select step, layer, end_ns from spans where kind = 'optimizer'\")}
    units = db.execute(\"select count(distinct layer) from spans where kind = 'optimizer'\").fetchone()[0]
    assert len(rows) == 2 * units, (path, len(rows), units)
    for lane, step, layer, start, nbytes in rows:
        assert lane.startswith('CPU optimizer') and nbytes >= 0 and start >= adam[(step, layer)], (path, lane, step, layer)
    assert sum(r[4] for r in rows) > 0, path  # bytes received: 0 only for a unit this rank owns whole
PY"

# ---- a rank that dies ----------------------------------------------------------------------------
# Rank 1 is killed mid-run: the job ends within 60 s, non-zero, naming the rank, and the newest
# checkpoint loads.
plan long 2 4 2
# long_run NAME [flags]: starts a long 2-rank run of plan $long_plan (default long) in the background
# (its pid in $job), waits for its step-10 checkpoint, and sets $victim to rank 1's process.
long_plan=long
long_run() {
  local name=$1
  shift
  rm -rf "$tmp/k"
  mpirun -np 2 "$exe" "$tmp/$long_plan.json" --data "$tmp/text.txt" --threads 1 --steps 100000 --checkpoint-dir "$tmp/k" \
    --checkpoint-every 5 "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
  job=$!
  for _ in $(seq 1 600); do [ -d "$tmp/k/step-00000010" ] && break; sleep 0.1; done
  victim=""
  for p in $(pgrep -f "$tmp/$long_plan.json"); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1'; then victim=$p; fi
  done
}
long_run kill
killed_at=$(date +%s)
[ -n "$victim" ] && kill -9 "$victim"
wait $job
rc=$?
took=$(($(date +%s) - killed_at))
check "killing rank 1 mid-run ends the job non-zero within 60 s ($took s), naming rank 1" \
  "[ -n '$victim' ] && [ $rc -ne 0 ] && [ $took -le 60 ] && grep -q 'rank 1' $tmp/kill.err"
run2 long --steps 12 --checkpoint-dir "$tmp/k" --resume >"$tmp/out" 2>"$tmp/err"
rc=$?
check "after the kill the newest complete checkpoint loads" "[ $rc -eq 0 ] && { grep -q 'resuming from' $tmp/out || grep -q 'nothing to run' $tmp/out; }"

# ---- a rank that hangs ---------------------------------------------------------------------------
# Rank 1 is stopped (SIGSTOP) mid-run: rank 0 waits --collective-timeout 5 s in a collective, asks
# rank 1 whether it is alive, gets no answer within 5 s, names it and ends the job.
long_run hang --collective-timeout 5
stopped_at=$(date +%s)
[ -n "$victim" ] && kill -STOP "$victim"
wait $job
rc=$?
took=$(($(date +%s) - stopped_at))
[ -n "$victim" ] && kill -9 "$victim" 2>/dev/null
check "stopping rank 1 mid-run ends the job non-zero within 60 s ($took s), rank 0 naming rank 1 as not answering" \
  "[ -n '$victim' ] && [ $rc -ne 0 ] && [ $took -le 60 ] && grep -q 'rank 0 of 2: waited [0-9]* s in .*rank 1 did not answer' $tmp/hang.err"
run2 long --steps 12 --checkpoint-dir "$tmp/k" --resume >"$tmp/out" 2>"$tmp/err"
rc=$?
check "after the hang the newest complete checkpoint loads" "[ $rc -eq 0 ] && { grep -q 'resuming from' $tmp/out || grep -q 'nothing to run' $tmp/out; }"

# The same kill with a shared host state: the job ends, the node's shared memory goes with its
# processes (the file was unlinked once mapped, so /dev/shm holds nothing of it), the checkpoint loads.
plan long-shared 2 4 2 "d['parallel']['host_state'] = 'shared'"
long_plan=long-shared
shm_before=$(ls /dev/shm 2>/dev/null | grep -c '^megatrain-')
long_run kill-shared
killed_at=$(date +%s)
[ -n "$victim" ] && kill -9 "$victim"
wait $job
rc=$?
took=$(($(date +%s) - killed_at))
check "killing rank 1 of a shared-state job ends it non-zero within 60 s ($took s), leaving nothing in /dev/shm" \
  "[ -n '$victim' ] && [ $rc -ne 0 ] && [ $took -le 60 ] && [ \$(ls /dev/shm 2>/dev/null | grep -c '^megatrain-') -eq $shm_before ]"
run2 long-shared --steps 12 --checkpoint-dir "$tmp/k" --resume >"$tmp/out" 2>"$tmp/err"
rc=$?
check "after the kill the shared job's newest checkpoint loads" "[ $rc -eq 0 ] && { grep -q 'resuming from' $tmp/out || grep -q 'nothing to run' $tmp/out; }"

[ $fails -eq 0 ] && echo "all data-parallel checks passed" || echo "$fails check(s) failed"
exit $((fails > 0))
