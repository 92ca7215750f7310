#!/usr/bin/env bash
# megatrain-plan simulate on the shipped example plans: --json carries the keys of ARCHITECTURE.md
# section 8, --trace writes a trace an independent reader (Python's sqlite3) can open, and a plan
# that does not fit or is malformed fails with a message naming the tier or the field.
set -uo pipefail
plan=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }

for p in tiny-cpu llama-2-70b-h200 mistral-large-2-h200; do
  "$plan" simulate "$src/profiles/plans/$p.json" --json --trace "$tmp/$p.mtrace" >"$tmp/$p.json" 2>"$tmp/err"
  check "$p: simulate --json exits 0" "[ $? -eq 0 ]"
  check "$p: nothing on stderr" "[ ! -s $tmp/err ]"
  check "$p: JSON has the section-8 keys and sane values" "/usr/bin/python3 - $tmp/$p.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
keys = ['feasible', 'step_time_s', 'tokens_per_s', 'tflops', 'mfu', 'bottleneck', 'busy', 'stalls', 'peak_bytes']
assert all(k in d for k in keys), [k for k in keys if k not in d]
assert d['feasible'] is True and d['step_time_s'] > 0 and 0 < d['mfu'] <= 1
assert d['bottleneck'] in ('gpu', 'h2d', 'd2h', 'cpu', 'host_memory', 'nvme_read', 'nvme_write', 'none')
assert set(d['peak_bytes']) == {'device', 'pinned', 'ram', 'nvme'}
assert all(0 <= v <= 1 + 1e-9 for v in d['busy'].values()), d['busy']
for tier, used in d['peak_bytes'].items():
    assert used <= d['capacity_bytes'][tier], tier
PY"
  check "$p: the trace has six lanes, spans and per-tier counters" "/usr/bin/python3 - $tmp/$p.mtrace $tmp/$p.json <<'PY'
import json, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
assert db.execute('select value from meta where key=\"source\"').fetchone()[0] == 'simulated'
assert db.execute('select count(*) from lanes').fetchone()[0] == 6
assert db.execute('select count(*) from spans').fetchone()[0] > 0
names = {r[0] for r in db.execute('select distinct name from counters')}
# bytes.nvme only for a plan that keeps state on the drives (simulator/src/report.cpp skips a zero one)
uses_nvme = json.load(open(sys.argv[2]))['peak_bytes']['nvme'] > 0
assert {'bytes.device', 'bytes.pinned', 'bytes.ram'} <= names, names
assert ('bytes.nvme' in names) == uses_nvme, names
bad = db.execute('select count(*) from spans where end_ns < start_ns').fetchone()[0]
assert bad == 0
PY"
done

/usr/bin/python3 -c "
import json; d = json.load(open('$src/profiles/plans/tiny-cpu.json'))
d['model'] = 'tiny-llama-gqa'; d['rig'] = 'cpu-dev-2core'; d['placement']['device_budget_bytes'] = 1048576
json.dump(d, open('$tmp/small.json', 'w'))"
"$plan" simulate "$tmp/small.json" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a plan that does not fit exits non-zero" "[ $rc -ne 0 ]"
check "it names the tier and the excess" "grep -q 'device' $tmp/err && grep -q 'over by' $tmp/err"

sed 's/"prefetch_depth": 1/"prefetch_depth": "one"/' "$src/profiles/plans/tiny-cpu.json" >"$tmp/bad.json"
"$plan" simulate "$tmp/bad.json" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a malformed plan exits non-zero" "[ $rc -ne 0 ]"
check "it names the field" "grep -q 'schedule.prefetch_depth' $tmp/err"

"$plan" simulate "$tmp/none.json" >"$tmp/out" 2>"$tmp/err"
check "a missing plan file exits non-zero naming it" "[ $? -ne 0 ] && grep -q 'none.json' $tmp/err"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
