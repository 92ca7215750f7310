#!/usr/bin/env bash
# The NVMe tier as a user meets it: a rig whose RAM is too small for small-llama's state makes the
# planner put state on NVMe and say why; megatrain-exec trains that plan with the loss falling, the
# same losses as with everything in RAM, checkpoints and resumes it, leaves no state files behind,
# and refuses a missing directory or a file-size limit too small before training.
set -uo pipefail
plan_exe=$1
src=$2
exe="$(dirname "$1")/megatrain-exec"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }
head -c 40000 /usr/share/common-licenses/GPL-3 >"$tmp/text.txt" 2>/dev/null || yes "the quick brown fox jumps over the lazy dog" | head -c 40000 >"$tmp/text.txt"
mkdir -p "$tmp/nvme"

# A rig like the dev VM, with RAM_BYTES of RAM and its drive at $tmp/nvme.
make_rig() {
  /usr/bin/python3 - "$src/profiles/hardware/cpu-dev-2core.json" "$tmp/rig-$1.json" "$1" "$tmp/nvme" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ram = float(sys.argv[3])
r["name"] = "small-ram"
r["host"]["ram_bytes"]["value"] = ram
r["host"]["pinnable_bytes"]["value"] = ram
r["storage"][0]["path"] = sys.argv[4]
json.dump(r, open(sys.argv[2], "w"))
PY
}

make_rig 70000000
"$plan_exe" plan --model small-llama --rig "$tmp/rig-70000000.json" --seq 64 --tokens-per-step 256 -o "$tmp/plan.json" >"$tmp/out" 2>"$tmp/err"
check "with 70 MB of RAM the planner puts the optimizer states on NVMe" \
  "[ $? -eq 0 ] && /usr/bin/python3 -c \"import json; p = json.load(open('$tmp/plan.json'))['placement']; assert p['optimizer_states'] == 'nvme' and p['nvme_dirs'] == ['$tmp/nvme'], p\""
check "and says it is because RAM is short" "grep -q 'go to NVMe because RAM is short' $tmp/out"

"$exe" "$tmp/plan.json" --data "$tmp/text.txt" --steps 6 --checkpoint-dir "$tmp/ck" >"$tmp/nvme.out" 2>"$tmp/err"
check "trains 6 steps with the NVMe tier" "[ $? -eq 0 ] && grep -q '^NVMe tier: optimizer states' $tmp/nvme.out && [ \$(grep -c '^step' $tmp/nvme.out) -eq 6 ]"
check "the loss falls" "awk '/^step/ {l[n++]=\$4} END {exit !(l[n-1] < l[0] - 0.2)}' $tmp/nvme.out"
check "no state file is left behind" "[ -z \"\$(ls -A $tmp/nvme)\" ]"

/usr/bin/python3 -c "
import json; d = json.load(open('$tmp/plan.json'))
d['placement'].update({'master_weights': 'ram', 'optimizer_states': 'ram', 'nvme_dirs': [], 'pinned_staging_bytes': 0})
d['rig'] = '$src/profiles/hardware/cpu-dev-2core.json'  # all of it in RAM needs more than the small rig has
json.dump(d, open('$tmp/ram.json', 'w'))"
"$exe" "$tmp/ram.json" --data "$tmp/text.txt" --steps 6 >"$tmp/ram.out" 2>"$tmp/err"
check "the same plan with everything in RAM gives the same losses" \
  "[ $? -eq 0 ] && diff <(awk '/^step/ {print \$4}' $tmp/nvme.out) <(awk '/^step/ {print \$4}' $tmp/ram.out) >/dev/null"

"$exe" "$tmp/plan.json" --data "$tmp/text.txt" --steps 8 --checkpoint-dir "$tmp/ck" --resume >"$tmp/out" 2>"$tmp/err"
check "resumes from the NVMe run's checkpoint" "[ $? -eq 0 ] && grep -q 'resuming from' $tmp/out && [ \$(grep -c '^step' $tmp/out) -eq 2 ]"
"$exe" "$tmp/ram.json" --data "$tmp/text.txt" --steps 8 >"$tmp/ram8.out" 2>"$tmp/err"
check "and continues as the uninterrupted run does" \
  "diff <(awk '/^step/ {print \$4}' $tmp/out) <(awk '/^step/ {print \$4}' $tmp/ram8.out | tail -2) >/dev/null"

/usr/bin/python3 -c "
import json; d = json.load(open('$tmp/plan.json')); d['placement']['nvme_dirs'] = ['$tmp/no-such-dir']
json.dump(d, open('$tmp/missing.json', 'w'))"
"$exe" "$tmp/missing.json" --data "$tmp/text.txt" --steps 2 >"$tmp/out" 2>"$tmp/err"
check "a missing NVMe directory is refused before training, naming it" \
  "[ $? -ne 0 ] && grep -q 'no-such-dir' $tmp/err && ! grep -q '^step' $tmp/out"
(ulimit -f 1024; "$exe" "$tmp/plan.json" --data "$tmp/text.txt" --steps 2 >"$tmp/out" 2>"$tmp/err")
check "a file-size limit below the state is refused before training" \
  "[ $? -ne 0 ] && grep -q 'RLIMIT_FSIZE' $tmp/err && ! grep -q '^step' $tmp/out"

make_rig 52000000
"$plan_exe" plan --model small-llama --rig "$tmp/rig-52000000.json" --seq 64 --tokens-per-step 256 -o "$tmp/plan70.json" >"$tmp/out" 2>"$tmp/err"
check "with 52 MB the planner puts the master weights on NVMe with a bf16 copy" \
  "[ $? -eq 0 ] && /usr/bin/python3 -c \"import json; p = json.load(open('$tmp/plan70.json')); assert p['placement']['master_weights'] == 'nvme' and p['precision']['transfer'] == 'bf16', p\""
"$exe" "$tmp/plan70.json" --data "$tmp/text.txt" --steps 4 >"$tmp/out" 2>"$tmp/err"
check "and megatrain-exec trains it" "[ $? -eq 0 ] && grep -q '^NVMe tier: master weights' $tmp/out && [ \$(grep -c '^step' $tmp/out) -eq 4 ]"

[ $fails -eq 0 ] && echo "all NVMe CLI checks passed" || echo "$fails NVMe CLI check(s) failed"
exit $((fails > 0))
