#!/usr/bin/env bash
# Data parallelism on the CPU backend (issue 20, docs/data-parallel.md): 2 ranks (mpirun, one
# compute thread each) against one process (two compute threads) training the same rows of
# small-llama, interleaved, 3 rounds, in the same run. Prints each side's tokens/s over the steps
# after the first, their ratio (>1: 2 ranks are faster), and from the ranks' traces the share of the
# step spent summing gradients (grad_sum spans) and how much of that time the rank's compute lane
# was busy too (the overlap with the backward of the layers below). A third side runs the 2 ranks
# with sharded optimizer states (parallel.host_state sharded): its tokens/s against the replicated
# ranks', and the share of its step in weight_gather spans (the new weights from their owners). A
# fourth runs them with one host state per node (parallel.host_state shared): its tokens/s against
# the replicated ranks', and its weight_gather share (there the wait for the node's other owners).
#   bench/data-parallel.sh [build-dir] [steps]
set -euo pipefail
build=${1:-build}
steps=${2:-12}
exe=$build/bin/megatrain-exec
src=$(cd "$(dirname "$0")/.." && pwd)
command -v mpirun >/dev/null || { echo "no mpirun: install openmpi-bin (scripts/setup.sh)" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat /usr/share/common-licenses/* >"$tmp/text.txt"
/usr/bin/python3 - "$src/profiles/plans/tiny-cpu.json" "$tmp" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d['model'] = 'small-llama'
d['training'].update(seq_len=128, micro_batch=4, grad_accum=8, steps=1000)
d['schedule'].update(checkpoint_every=1, checkpoint_location='device')
d['placement']['device_budget_bytes'] = 0
d['optimizer']['threads'] = 0
json.dump(d, open(sys.argv[2] + '/one.json', 'w'))
d['training']['grad_accum'] = 4
d['parallel'] = {'data_parallel': 2}
json.dump(d, open(sys.argv[2] + '/two.json', 'w'))
d['parallel']['host_state'] = 'sharded'
json.dump(d, open(sys.argv[2] + '/sharded.json', 'w'))
d['parallel']['host_state'] = 'shared'
json.dump(d, open(sys.argv[2] + '/shared.json', 'w'))
PY
for round in 1 2 3; do
  "$exe" "$tmp/one.json" --data "$tmp/text.txt" --steps "$steps" --threads 2 --trace "$tmp/one-$round.mtrace" >"$tmp/one-$round.out"
  mpirun -np 2 "$exe" "$tmp/two.json" --data "$tmp/text.txt" --steps "$steps" --threads 1 --trace "$tmp/two-$round.mtrace" >"$tmp/two-$round.out"
  mpirun -np 2 "$exe" "$tmp/sharded.json" --data "$tmp/text.txt" --steps "$steps" --threads 1 --trace "$tmp/sharded-$round.mtrace" >"$tmp/sharded-$round.out"
  mpirun -np 2 "$exe" "$tmp/shared.json" --data "$tmp/text.txt" --steps "$steps" --threads 1 --trace "$tmp/shared-$round.mtrace" >"$tmp/shared-$round.out"
done
/usr/bin/python3 - "$tmp" <<'PY'
import sqlite3, sys
tmp = sys.argv[1]
def rate(path):  # tokens/s over the steps after the first
    rows = sqlite3.connect(path).execute('select tokens, time_s from steps where step > 0').fetchall()
    return sum(t for t, _ in rows) / sum(s for _, s in rows)
def busy(intervals):  # merged intervals
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out
def collective(path, kind='grad_sum'):  # (share of the steps after the first, share of it overlapped by compute)
    db = sqlite3.connect(path)
    step_s = db.execute('select sum(time_s) from steps where step > 0').fetchone()[0]
    sums = db.execute("select start_ns, end_ns from spans where kind = ? and step > 0", (kind,)).fetchall()
    gpu = db.execute("select id from lanes where kind = 'gpu'").fetchone()[0]
    compute = busy(db.execute('select start_ns, end_ns from spans where lane = ? and step > 0 and kind != ?', (gpu, 'stall')).fetchall())
    total = sum(b - a for a, b in sums)
    covered = 0
    for a, b in sums:
        for c, d in compute:
            covered += max(0, min(b, d) - max(a, c))
    return total / 1e9 / step_s, covered / total if total else 0.0
print('round  one process tok/s  2 ranks tok/s  ratio  grad_sum share (rank 0 / 1)  overlapped with compute (rank 0 / 1)')
for r in (1, 2, 3):
    one, two = rate(f'{tmp}/one-{r}.mtrace'), rate(f'{tmp}/two-{r}.mtrace')
    c0, c1 = collective(f'{tmp}/two-{r}.mtrace'), collective(f'{tmp}/two-{r}.rank1.mtrace')
    print(f'{r:5d}  {one:18.0f}  {two:13.0f}  {two / one:5.2f}  {100 * c0[0]:12.1f}% / {100 * c1[0]:.1f}%  {100 * c0[1]:22.1f}% / {100 * c1[1]:.1f}%')
for side in ('sharded', 'shared'):
    print(f'round  {side} tok/s  x replicated  grad_sum share (rank 0 / 1)  weight_gather share (rank 0 / 1)')
    for r in (1, 2, 3):
        two, sh = rate(f'{tmp}/two-{r}.mtrace'), rate(f'{tmp}/{side}-{r}.mtrace')
        g0, g1 = collective(f'{tmp}/{side}-{r}.mtrace'), collective(f'{tmp}/{side}-{r}.rank1.mtrace')
        w0, w1 = collective(f'{tmp}/{side}-{r}.mtrace', 'weight_gather'), collective(f'{tmp}/{side}-{r}.rank1.mtrace', 'weight_gather')
        print(f'{r:5d}  {sh:{len(side) + 6}.0f}  {sh / two:12.2f}  {100 * g0[0]:12.1f}% / {100 * g1[0]:.1f}%  {100 * w0[0]:20.1f}% / {100 * w1[0]:.1f}%')
PY
