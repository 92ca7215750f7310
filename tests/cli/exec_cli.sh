#!/usr/bin/env bash
# megatrain-exec as a user runs it: trains the tiny plan on a text file with the loss falling, writes
# a measured trace that Python's sqlite3 can read, and refuses bad input with a clear message.
set -uo pipefail
src=$2
exe="$(dirname "$1")/megatrain-exec"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }
head -c 20000 /usr/share/common-licenses/GPL-3 >"$tmp/text.txt" 2>/dev/null || yes "the quick brown fox jumps over the lazy dog" | head -c 20000 >"$tmp/text.txt"

"$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --steps 12 --trace "$tmp/run.mtrace" >"$tmp/out" 2>"$tmp/err"
check "trains 12 steps" "[ $? -eq 0 ] && [ \$(grep -c '^step' $tmp/out) -eq 12 ]"
check "the loss falls" "awk '/^step/ {l[n++]=\$4} END {exit !(l[n-1] < l[0] - 0.3)}' $tmp/out"
check "the trace is a measured run with steps and spans" "/usr/bin/python3 - $tmp/run.mtrace <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
assert db.execute('select value from meta where key=\"source\"').fetchone()[0] == 'measured'
assert db.execute('select count(*) from steps').fetchone()[0] == 12
kinds = {r[0] for r in db.execute('select distinct kind from spans')}
assert {'forward', 'backward', 'recompute', 'h2d', 'd2h', 'optimizer'} <= kinds, kinds
losses = [r[0] for r in db.execute('select loss from steps order by step')]
assert losses[-1] < losses[0]
PY"

# Evaluation: every 4 steps and after the last, on a held-out file; the trace's steps.eval_loss has
# the same figures at those steps and NULL elsewhere, and the loss on held-out text falls too.
head -c 12000 "$tmp/text.txt" | tail -c 4000 >"$tmp/held-out.txt"
"$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --steps 10 --eval-data "$tmp/held-out.txt" --eval-every 4 \
  --trace "$tmp/eval.mtrace" >"$tmp/out" 2>"$tmp/err"
check "evaluates after steps 4, 8 and 10" "[ $? -eq 0 ] && [ \"\$(grep -o '^eval after step [0-9]*' $tmp/out | awk '{print \$4}' | tr '\n' ' ')\" = '4 8 10 ' ]"
check "the eval lines count every row of the held-out file once (31 rows of 128)" "[ \$(grep -c 'over 3968 targets of 31 rows' $tmp/out) -eq 3 ]"
check "the trace's eval_loss matches the lines and the held-out loss falls" "/usr/bin/python3 - $tmp/eval.mtrace $tmp/out <<'PY'
import re, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
rows = db.execute('select step, eval_loss from steps order by step').fetchall()
ev = {s: e for s, e in rows if e is not None}
assert sorted(ev) == [3, 7, 9], rows
printed = [float(m) for m in re.findall(r'^eval after step \\d+: loss ([0-9.]+)', open(sys.argv[2]).read(), re.M)]
assert [round(ev[s], 4) for s in (3, 7, 9)] == printed, (ev, printed)
assert ev[9] < ev[3]
PY"
"$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --eval-every 4 >"$tmp/out" 2>"$tmp/err"
check "--eval-every without --eval-data is refused" "[ $? -ne 0 ] && grep -q 'eval-data' $tmp/err"

"$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/missing.txt" >"$tmp/out" 2>"$tmp/err"
check "a missing data file exits non-zero naming it" "[ $? -ne 0 ] && grep -q 'missing.txt' $tmp/err"

/usr/bin/python3 -c "
import json; d = json.load(open('$src/profiles/plans/tiny-cpu.json')); d['placement']['device_budget_bytes'] = 100000
json.dump(d, open('$tmp/small.json', 'w'))"
"$exe" "$tmp/small.json" --data "$tmp/text.txt" >"$tmp/out" 2>"$tmp/err"
check "a device budget too small is refused before training, with the bytes needed" \
  "[ $? -ne 0 ] && grep -q 'needs' $tmp/err && ! grep -q '^step' $tmp/out"

"$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --steps 1 --backend cpu >"$tmp/out" 2>"$tmp/err"
check "--backend cpu trains and says which backend" "[ $? -eq 0 ] && grep -q 'on the CPU backend' $tmp/out"
"$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --steps 1 --backend cuda >"$tmp/out" 2>"$tmp/err"
rc=$?
if grep -q 'no usable GPU' "$tmp/err"; then
  check "--backend cuda without a GPU exits non-zero, says why and what is accepted" \
    "[ $rc -ne 0 ] && grep -q 'accepted here: --backend cpu' $tmp/err && ! grep -q '^step' $tmp/out"
else
  echo "skip: --backend cuda without a GPU (a GPU is present here: $(head -c 200 "$tmp/err"))"
fi
"$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --backend tpu >"$tmp/out" 2>"$tmp/err"
check "an unknown backend is refused listing the accepted ones" "[ $? -ne 0 ] && grep -q 'cuda' $tmp/err"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
