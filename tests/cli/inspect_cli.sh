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

# --ops: each kind of layer's ops. tiny-qwen3-moe (H 64, 4 heads x 16, 2 KV heads, dense MLP 96
# on layer 1, 8 experts of 32, top 2) at seq 128, by hand: a dense layer 2(64x64 + 2 x 64x32 +
# 64x64) + 3 x 2 x 64x96 + 4 x 128 x 64 = 94,208 FLOPs a token; a MoE layer the same attention,
# the router 2 x 64 x 8 and 2 x 3 x 2 x 64 x 32 for its two experts = 82,944.
"$plan" inspect --model tiny-qwen3-moe --seq 128 --ops --json >"$tmp/ops.json" 2>"$tmp/err"
check "inspect --ops --json exits 0" "[ $? -eq 0 ] && [ ! -s $tmp/err ]"
check "inspect --ops: a dense and a MoE layer, their ops' FLOPs as by hand" \
  "/usr/bin/python3 -c 'import json,sys; d=json.load(open(\"$tmp/ops.json\"))[\"layer_ops\"]; f=lambda k: sum(o[\"forward_flops_per_token\"] for o in d[k][\"ops\"]); sys.exit(0 if (f(\"dense\"), f(\"moe\"), d[\"dense\"][\"first_layer\"], d[\"moe\"][\"first_layer\"]) == (94208, 82944, 1, 0) else 1)'"
"$plan" inspect --model tiny-qwen3-moe --seq 128 --ops >"$tmp/ops.txt" 2>&1
check "inspect --ops table lists the MoE layer's grouped linears" \
  "grep -q 'Ops of a moe layer (layer 0)' $tmp/ops.txt && grep -q 'experts.down *grouped linear *2 x 32 -> 64' $tmp/ops.txt"
check "inspect --ops names the values each op reads and writes (Qwen3: q_pre, k_pre through the head norms)" \
  "grep -q 'q_norm, k_norm .* q_pre, k_pre -> q, k\$' $tmp/ops.txt && grep -q 'mlp residual .* h + out -> out\$' $tmp/ops.txt && /usr/bin/python3 -c 'import json,sys; o={x[\"name\"]: x for x in json.load(open(\"$tmp/ops.json\"))[\"layer_ops\"][\"moe\"][\"ops\"]}; sys.exit(0 if (o[\"o_proj\"][\"reads\"], o[\"o_proj\"][\"writes\"], o[\"route\"][\"writes\"], o[\"attention\"][\"reads\"]) == ([\"attn\"], \"h\", None, [\"q, k\", \"v\"]) else 1)'"

"$plan" frobnicate >"$tmp/out" 2>"$tmp/err"
check "unknown subcommand exits non-zero" "[ $? -ne 0 ]"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
