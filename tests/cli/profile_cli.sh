#!/usr/bin/env bash
# megatrain-plan profile --quick: --json prints one JSON object (rig, fits) on stdout, -o writes a rig
# that the simulator accepts in a plan, the temp file is gone afterwards, and an unusable --storage
# directory fails at once, naming it.
set -uo pipefail
plan=$1
src=$2
# On the build's file system (ext4 here), not /tmp, which is tmpfs on some machines (no O_DIRECT).
tmp=$(mktemp -d "$(dirname "$plan")/profile-cli.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }

mkdir -p "$tmp/disk"
start=$(date +%s)
"$plan" profile --quick --storage "$tmp/disk" -o "$tmp/rig.json" --json >"$tmp/out.json" 2>"$tmp/err"
rc=$?
took=$(( $(date +%s) - start ))
echo "profile --quick took ${took} s"
check "profile --quick exits 0" "[ $rc -eq 0 ]"
[ $rc -eq 0 ] || cat "$tmp/err"
check "progress lines on stderr" "grep -q '^\[1/' $tmp/err"
check "stdout is one JSON object with rig and fits" "/usr/bin/python3 - $tmp/out.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert 'rig' in d and 'fits' in d, list(d)
r = d['rig']
assert r['schema'] == 'megatrain.rig/1'
assert r['host']['memory_bandwidth']['provenance']['kind'] == 'measured'
assert r['gpu']['matmul_fp32']['value'] > 0
pts = r['gpu']['gemm_efficiency']['points']
assert all(b[0] > a[0] for a, b in zip(pts, pts[1:])) and all(0 < y <= 1 for _, y in pts)
assert len(r['storage']) == 1 and len(r['storage'][0]['read']) >= 2
for name, f in d['fits'].items():
    assert f['rms_rel_residual'] >= 0, name
PY"
check "the rig has a host.adam rate for every state format" "/usr/bin/python3 - $tmp/out.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))['rig']
adam = r['host']['adam']
have = {a['state_format'] for a in adam}
want = {'fp32', 'bf16', 'q8', 'q4', 'q3', 'q2'}
assert have == want, sorted(have)
for f in want:
    top = max(a['threads'] for a in adam if a['state_format'] == f)
    assert top == r['host']['cores'], (f, top)
assert all(a['params_per_s']['value'] > 0 and a['params_per_s']['provenance']['kind'] == 'measured' for a in adam)
pairs = [(a['state_format'], a['threads']) for a in adam]
assert len(pairs) == len(set(pairs)), pairs
PY"
check "the rig file is the rig printed" "/usr/bin/python3 -c \"
import json; a = json.load(open('$tmp/rig.json')); b = json.load(open('$tmp/out.json'))['rig']
assert a == b, 'differs'\""
check "no temp file left in the storage directory" "[ -z \"\$(ls -A $tmp/disk)\" ]"

/usr/bin/python3 -c "
import json; d = json.load(open('$src/profiles/plans/tiny-cpu.json'))
d['rig'] = '$tmp/rig.json'
json.dump(d, open('$tmp/plan.json', 'w'))"
"$plan" simulate "$tmp/plan.json" --json >"$tmp/sim.json" 2>"$tmp/err"
rc=$?
check "simulate accepts a plan on the measured rig" "[ $rc -eq 0 ]"
[ $rc -eq 0 ] || cat "$tmp/err"
check "and predicts a step" "/usr/bin/python3 -c \"
import json; d = json.load(open('$tmp/sim.json')); assert d['feasible'] and d['step_time_s'] > 0\""

"$plan" profile --quick --storage /nonexistent-megatrain-dir >"$tmp/out" 2>"$tmp/err"
rc=$?
check "--storage /nonexistent-megatrain-dir fails" "[ $rc -ne 0 ]"
check "naming the directory" "grep -q '/nonexistent-megatrain-dir' $tmp/err"
check "before measuring anything" "! grep -q '^\[1/' $tmp/err"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
