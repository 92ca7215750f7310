#!/usr/bin/env bash
# megatrain-plan plan and size: --json parses with an independent reader (Python's json), -o writes
# a plan that loads and simulates, an impossible request exits 2 with a per-tier explanation, and
# a bad model name or rig file fails with a message naming it.
set -uo pipefail
plan=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }

"$plan" plan --model llama-2-7b --rig rtx4090-256gb --json -o "$tmp/p.json" >"$tmp/out.json" 2>"$tmp/err"
check "plan --json exits 0" "[ $? -eq 0 ]"
check "nothing on stderr" "[ ! -s $tmp/err ]"
check "plan --json has plan (with predicted) and alternatives" "/usr/bin/python3 - $tmp/out.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d['feasible'] is True
p = d['plan']
assert p['schema'] == 'megatrain.plan/1'
assert p['predicted']['tokens_per_s'] > 0 and p['predicted']['bottleneck']
assert isinstance(d['alternatives'], list) and len(d['alternatives']) > 0
for a in d['alternatives']:
    assert a['tokens_per_s'] <= p['predicted']['tokens_per_s'] and 'slower' in a['why']
assert d['bottleneck']['text'] and d['search']['simulated'] > 0
PY"
"$plan" simulate "$tmp/p.json" --json >"$tmp/sim.json" 2>"$tmp/err"
check "the written plan simulates feasibly" "[ $? -eq 0 ] && /usr/bin/python3 -c \"import json; d = json.load(open('$tmp/sim.json')); assert d['feasible'] is True\""
check "the written plan's prediction is the simulator's" "/usr/bin/python3 -c \"
import json; a = json.load(open('$tmp/p.json'))['predicted']['tokens_per_s']; b = json.load(open('$tmp/sim.json'))['tokens_per_s']
assert abs(a - b) <= 1e-9 * b, (a, b)\""

"$plan" plan --model tiny-llama-gqa --rig cpu-dev-2core --seq 128 --tokens-per-step 1024 -o "$tmp/cpu.json" >"$tmp/out" 2>"$tmp/err"
check "a CPU-backend plan: fp32 compute, states in RAM" "[ $? -eq 0 ] && /usr/bin/python3 -c \"
import json; p = json.load(open('$tmp/cpu.json'))
assert p['precision']['compute'] == 'fp32' and p['precision']['transfer'] == 'fp32'
assert p['placement']['master_weights'] == 'ram' and p['placement']['optimizer_states'] == 'ram'\""
check "the table names the best plan and the bottleneck" "grep -q 'best plan' $tmp/out && grep -q 'bound' $tmp/out"
"$plan" plan --model tiny-llama-gqa --rig cpu-dev-2core --seq 128 --tokens-per-step 1024 --micro-batch 2 -o "$tmp/mb.json" >/dev/null 2>"$tmp/err"
check "--micro-batch 2 fixes the micro-batch (8 sequences: accumulation 4)" "[ $? -eq 0 ] && /usr/bin/python3 -c \"
import json; t = json.load(open('$tmp/mb.json'))['training']; assert (t['micro_batch'], t['grad_accum']) == (2, 4), t\""
"$plan" plan --model tiny-llama-gqa --rig cpu-dev-2core --seq 128 --tokens-per-step 1024 --micro-batch 3 >/dev/null 2>"$tmp/err"
check "--micro-batch 3 of 8 sequences is refused by name" "[ $? -eq 1 ] && grep -q 'micro-batch 3 does not divide' $tmp/err"

/usr/bin/python3 -c "
import json; d = json.load(open('$src/profiles/hardware/rtx4090-256gb.json'))
d['host']['ram_bytes']['value'] = 24 * 2**30; d['host']['pinnable_bytes']['value'] = 20 * 2**30; d['storage'] = []
json.dump(d, open('$tmp/small-rig.json', 'w'))"
"$plan" plan --model mistral-large-2 --rig "$tmp/small-rig.json" >"$tmp/out" 2>"$tmp/err"
check "an impossible request exits 2" "[ $? -eq 2 ]"
check "it names the tiers and the shortfall" "grep -q 'ram needs' $tmp/err && grep -q 'short by' $tmp/err"
"$plan" plan --model mistral-large-2 --rig "$tmp/small-rig.json" --json >"$tmp/out.json" 2>/dev/null
check "with --json it prints feasible false and the shortfalls" "/usr/bin/python3 -c \"
import json; d = json.load(open('$tmp/out.json')); assert d['feasible'] is False
assert any(s['tier'] == 'ram' and s['short_bytes'] > 0 for s in d['shortfalls'])\""

"$plan" plan --model llama-9-1t --rig h200-1.5tb >"$tmp/out" 2>"$tmp/err"
check "a bad model name fails naming it and the known ones" "[ $? -eq 1 ] && grep -q 'llama-9-1t' $tmp/err && grep -q 'llama-2-70b' $tmp/err"
echo '{"schema": "megatrain.rig/1", "name": "x", "gpu": {}}' >"$tmp/bad-rig.json"
"$plan" plan --model llama-2-7b --rig "$tmp/bad-rig.json" >"$tmp/out" 2>"$tmp/err"
check "a bad rig file fails naming the file and the field" "[ $? -eq 1 ] && grep -q 'bad-rig.json' $tmp/err && grep -q 'missing' $tmp/err"
"$plan" plan --model llama-2-7b --rig h200-1.5tb --tokens-per-step 1000 >"$tmp/out" 2>"$tmp/err"
check "tokens per step not a multiple of seq fails naming what is accepted" "[ $? -eq 1 ] && grep -q 'multiple' $tmp/err"
"$plan" plan --model llama-2-7b --rig h200-1.5tb --state-formats fp32,q5 >"$tmp/out" 2>"$tmp/err"
check "an unknown state format fails naming it" "[ $? -eq 1 ] && grep -q 'q5' $tmp/err"

"$plan" size --model llama-2-7b --gpu h100-sxm --json >"$tmp/size.json" 2>"$tmp/err"
check "size --json exits 0 and lists a rig that trains" "[ $? -eq 0 ] && /usr/bin/python3 -c \"
import json; d = json.load(open('$tmp/size.json'))
r = d['rigs'][0]; assert r['trains'] and r['ram_bytes'] > 0 and r['tokens_per_s'] > 0 and d['assumptions']\""
"$plan" size --family llama-2 --rig rtx4090-256gb --json >"$tmp/fam.json" 2>"$tmp/err"
check "size --family --json gives the largest model" "[ $? -eq 0 ] && /usr/bin/python3 -c \"
import json; d = json.load(open('$tmp/fam.json'))
assert d['trains_any'] and 6e9 < d['largest']['parameters'] < 7e10\""
"$plan" size --model llama-2-70b --rig h200x8-2tb-4node --target-tokens-per-s 8000 --json >"$tmp/gpus.json" 2>"$tmp/err"
check "size --model --rig on a cluster rig answers how many GPUs reach the target, with every count's figures" "[ $? -eq 0 ] && /usr/bin/python3 -c \"
import json; d = json.load(open('$tmp/gpus.json'))
c = {x['gpus']: x for x in d['counts']}
assert sorted(c) == [1, 2, 4, 8, 16, 32], sorted(c)
assert d['gpus'] == min(n for n, x in c.items() if x['trains']), d['gpus']
assert all(x['tokens_per_s'] >= 8000 for x in c.values() if x['trains']) and not c[1]['trains']
assert c[d['gpus']]['host_state'] in ('replicated', 'sharded', 'shared')\""
"$plan" size --model llama-2-70b --rig h200-1.5tb >"$tmp/out" 2>"$tmp/err"
check "size --model --rig with a one-GPU rig is refused, naming the cluster section" "[ $? -eq 1 ] && grep -q 'no cluster section' $tmp/err"
"$plan" size --model llama-2-7b --gpu voodoo >"$tmp/out" 2>"$tmp/err"
check "size with an unknown GPU fails listing the known ones" "[ $? -eq 1 ] && grep -q 'h200-1.5tb' $tmp/err"

# Mixture-of-Experts: the paper's gpt-oss-120b plans on its rig, both orders weighed; MoE models size.
"$plan" plan --model gpt-oss-120b --rig h200-1.5tb --json >"$tmp/moe.json" 2>"$tmp/err"
check "plan gpt-oss-120b on h200-1.5tb exits 0 with a plan" "[ $? -eq 0 ] && [ ! -s $tmp/err ]"
check "its JSON weighs both orders and counts every expert's bytes" "/usr/bin/python3 - $tmp/moe.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d['feasible'] is True
p = d['plan']
assert 0 < p['predicted']['mfu'] < 1 and p['predicted']['tokens_per_s'] > 0
o = d['order']
assert o['winner'] == p['schedule']['order'], o
assert o['other'] is not None and o['other']['order'] != o['winner'], o
assert o['speedup'] >= 1 and abs(o['speedup'] - o['tokens_per_s'] / o['other']['tokens_per_s']) < 1e-9
# 36 layers of 128 experts of 3 x 2880 x 2880 in bf16, twice a step at least: over 2 x 2 x 36 x 128 x 3 x 2880^2 bytes
assert o['weight_bytes_per_step'] > 2 * 2 * 36 * 128 * 3 * 2880 ** 2
assert o['text'].startswith(o['winner'] + ' wins') and 'bytes per kFLOP' in o['text']
assert d['search']['order_simulations'] > 0
PY"
"$plan" plan --model gpt-oss-120b --rig h200-1.5tb >"$tmp/moe.txt" 2>"$tmp/err"
check "the table has the order section" "grep -q '^order' $tmp/moe.txt && grep -q ' wins: ' $tmp/moe.txt"
for m in gpt-oss-120b qwen3-235b-a22b; do
  "$plan" size --model $m --gpu h200-1.5tb --json >"$tmp/size-$m.json" 2>"$tmp/err"
  check "size --model $m finds an H200 host that trains it" "[ $? -eq 0 ] && /usr/bin/python3 -c \"
import json; d = json.load(open('$tmp/size-$m.json'))
r = d['rigs'][0]; assert r['trains'] and r['tokens_per_s'] > 0, r\""
done
"$plan" size --family gpt-oss --rig h200-1.5tb >"$tmp/out" 2>"$tmp/err"
check "size --family of MoE models is refused by name" "[ $? -eq 1 ] && grep -q 'Mixture-of-Experts' $tmp/err && grep -q 'size --model' $tmp/err"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
