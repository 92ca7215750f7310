#!/usr/bin/env bash
# megatrain-plan inspect as users and scripts call it: --json prints one JSON object on stdout and
# nothing else; errors go to stderr, name the problem and exit non-zero.
set -uo pipefail
plan=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }

"$plan" inspect --model llama-2-70b --seq 4096 --json >"$tmp/out.json" 2>"$tmp/err"
check "inspect --json exits 0" "[ $? -eq 0 ]"
check "inspect --json writes nothing to stderr" "[ ! -s $tmp/err ]"
check "inspect --json stdout is one JSON object with the published count" \
  "/usr/bin/python3 -c 'import json,sys; d=json.load(open(\"$tmp/out.json\")); sys.exit(0 if d[\"parameters\"]==68976648192 and d[\"layers\"]==80 and d[\"head\"]==262144000 and d[\"embedding\"]==262144000 and isinstance(d[\"bytes\"], dict) and d[\"flops_per_token\"]>0 else 1)'"

"$plan" inspect --model llama-2-70b >"$tmp/table" 2>&1
check "inspect table shows the exact count" "grep -q '68,976,648,192' $tmp/table"

"$plan" inspect --model no-such-model --json >"$tmp/out" 2>"$tmp/err"
rc=$?
check "unknown model exits non-zero" "[ $rc -ne 0 ]"
check "unknown model: nothing on stdout" "[ ! -s $tmp/out ]"
check "unknown model: stderr names it and lists known models" "grep -q 'no-such-model' $tmp/err && grep -q 'llama-2-70b' $tmp/err"

printf '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,' >"$tmp/cut.json"
"$plan" inspect --model "$tmp/cut.json" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "truncated config exits non-zero" "[ $rc -ne 0 ]"
check "truncated config: stderr says where" "grep -q 'cut.json' $tmp/err && grep -q 'line 1' $tmp/err"

"$plan" inspect --model tiny-llama-gqa --seq 0 >"$tmp/out" 2>"$tmp/err"
check "--seq 0 is rejected" "[ $? -ne 0 ] && [ -s $tmp/err ]"

"$plan" frobnicate >"$tmp/out" 2>"$tmp/err"
check "unknown subcommand exits non-zero" "[ $? -ne 0 ]"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
