#!/usr/bin/env bash
# One rule per plan field (issue 16): megatrain-plan simulate and megatrain-exec refuse the same
# plans with the same message and exit status: NVMe-resident state without pinned staging for one
# unit, a duplicated key, a misspelt section (reported as unknown with a suggestion, not as missing).
set -uo pipefail
plan=$1
src=$2
exe="$(dirname "$1")/megatrain-exec"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }
mkdir -p "$tmp/nvme"
head -c 20000 /usr/share/common-licenses/GPL-3 >"$tmp/text.txt" 2>/dev/null || head -c 20000 "$src/README.md" >"$tmp/text.txt"

# Runs both programs on plan $1 (name in $tmp); leaves their exit codes in $rc_sim, $rc_exec and
# their error messages, without the program's name, in $tmp/$1.sim and $tmp/$1.exec.
both() {
  "$plan" simulate "$tmp/$1.json" >/dev/null 2>"$tmp/$1.sim.err"
  rc_sim=$?
  "$exe" "$tmp/$1.json" --data "$tmp/text.txt" --steps 1 --backend cpu >/dev/null 2>"$tmp/$1.exec.err"
  rc_exec=$?
  sed 's/^megatrain-plan: error: //' "$tmp/$1.sim.err" >"$tmp/$1.sim"
  sed 's/^megatrain-exec: error: //' "$tmp/$1.exec.err" >"$tmp/$1.exec"
}

# The issue's case: optimizer states on NVMe, pinned_staging_bytes 0.
/usr/bin/python3 -c "
import json; d = json.load(open('$src/profiles/plans/tiny-cpu.json'))
d['placement'].update({'optimizer_states': 'nvme', 'nvme_dirs': ['$tmp/nvme'], 'pinned_staging_bytes': 0})
json.dump(d, open('$tmp/staging0.json', 'w'))"
both staging0
check "nvme + staging 0: simulate refuses as an invalid plan (exit 1)" "[ $rc_sim -eq 1 ]"
check "nvme + staging 0: megatrain-exec refuses as an invalid plan (exit 1)" "[ $rc_exec -eq 1 ]"
check "nvme + staging 0: the same message from both" "[ -s $tmp/staging0.sim ] && diff $tmp/staging0.sim $tmp/staging0.exec"
check "it names the key, the value and the minimum in bytes" \
  "grep -Eq 'placement.pinned_staging_bytes: 0 cannot hold one unit.s NVMe transfer of [0-9]+ bytes .*accepted: >= [0-9]+' $tmp/staging0.sim"
check "no state file was created" "[ -z \"\$(ls -A $tmp/nvme)\" ]"

# The minimum it names is enough for both.
min=$(grep -Eo 'accepted: >= [0-9]+' "$tmp/staging0.sim" | grep -Eo '[0-9]+$')
/usr/bin/python3 -c "
import json; d = json.load(open('$tmp/staging0.json')); d['placement']['pinned_staging_bytes'] = int('${min:-0}')
json.dump(d, open('$tmp/staging-min.json', 'w'))"
both staging-min
check "staging of exactly the minimum: simulate accepts" "[ $rc_sim -eq 0 ]"
check "staging of exactly the minimum: megatrain-exec trains" "[ $rc_exec -eq 0 ]"

# A duplicated key: refused by both, naming its path.
sed 's/"seq_len": 128,/"seq_len": 0, "seq_len": 128,/' "$src/profiles/plans/tiny-cpu.json" >"$tmp/dup.json"
both dup
check "duplicate key: both exit 1" "[ $rc_sim -eq 1 ] && [ $rc_exec -eq 1 ]"
check "duplicate key: named with its path by both" "grep -q 'training.seq_len: duplicate key' $tmp/dup.sim && diff $tmp/dup.sim $tmp/dup.exec"

# A misspelt section: the unknown key with a suggestion, not 'training: missing'.
sed 's/"training"/"trainig"/' "$src/profiles/plans/tiny-cpu.json" >"$tmp/typo.json"
both typo
check "misspelt section: both exit 1 with the same message" "[ $rc_sim -eq 1 ] && [ $rc_exec -eq 1 ] && diff $tmp/typo.sim $tmp/typo.exec"
check "misspelt section: unknown key with did-you-mean" "grep -q 'trainig: unknown key; did you mean \"training\"?' $tmp/typo.sim"
check "misspelt section: not reported as missing" "! grep -q 'missing' $tmp/typo.sim"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
