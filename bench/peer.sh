#!/usr/bin/env bash
# The CPU backend against PyTorch 2 on the same training step (issues 21 and 46), interleaved in one
# run: small-llama (4.6M parameters), seq 128, micro-batch 4, grad_accum 4, fp32, clipping 1.0,
# AdamW, two threads each. PyTorch trains transformers' own LlamaForCausalLM built from
# profiles/models/small-llama.json (eager attention, torch.optim.AdamW, HF Trainer's loss), twice:
# eager, and under torch.compile (inductor, the model compiled once; its compile time is left out
# with the first step); megatrain-exec trains the same model and batch shape with every state in
# RAM, once keeping every activation (checkpoint_every 0, the same arithmetic as eager PyTorch) and
# once recomputing from per-layer checkpoints (checkpoint_every 1). Prints tokens/s over the steps
# after the first, per round, and the ratios against eager PyTorch (>1: MegaTrain is faster).
# Runs in the project's venv (scripts/python-env.sh: PyTorch 2.13 CPU, transformers).
#   bench/peer.sh [build-dir] [steps] [rounds]
set -euo pipefail
build=${1:-build}
steps=${2:-8}
rounds=${3:-2}
exe=$build/bin/megatrain-exec
py=$build/venv/bin/python
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat /usr/share/common-licenses/* >"$tmp/text.txt"
"$py" - "$src/profiles/plans/tiny-cpu.json" "$tmp" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d['model'] = 'small-llama'
d['training'].update(seq_len=128, micro_batch=4, grad_accum=4, steps=1000, clip_grad_norm=1.0)
d['schedule'].update(checkpoint_location='device')
d['placement']['device_budget_bytes'] = 0
d['optimizer']['threads'] = 0
for every in (0, 1):
    d['schedule']['checkpoint_every'] = every
    json.dump(d, open(f'{sys.argv[2]}/keep{every}.json', 'w'))
PY
cat >"$tmp/torch_peer.py" <<'PY'
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import transformers
torch.set_num_threads(2)
steps, text, mode = int(sys.argv[3]), open(sys.argv[2], 'rb').read(), sys.argv[4]
config = json.load(open(sys.argv[1] + '/profiles/models/small-llama.json'))
cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "transformers_version", "torch_dtype")})
cfg._attn_implementation = "eager"
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).float().train()
B, T, A = 4, 128, 4
tokens = torch.tensor(list(text[: (steps * A * B + 1) * T + 1]), dtype=torch.long)
decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
named = list(model.named_parameters())
opt = torch.optim.AdamW([{'params': [p for n, p in named if n in decay], 'weight_decay': 0.1},
                         {'params': [p for n, p in named if n not in decay], 'weight_decay': 0.0}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
forward = torch.compile(model) if mode == "compile" else model
times = []
for s in range(steps):
    t0 = time.perf_counter()
    for j in range(A):
        rows = torch.stack([tokens[((s * A + j) * B + b) * T:((s * A + j) * B + b) * T + T] for b in range(B)])
        loss = forward(input_ids=rows, labels=rows, num_items_in_batch=torch.tensor(A * B * (T - 1))).loss
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
print(A * B * T * (steps - 1) / sum(times[1:]))
PY
rate() {  # megatrain-exec's tokens/s over the steps after the first, from its trace
  "$py" -c "
import sqlite3, sys
rows = sqlite3.connect(sys.argv[1]).execute('select tokens, time_s from steps where step > 0').fetchall()
print(sum(t for t, _ in rows) / sum(s for _, s in rows))" "$1"
}
echo "PyTorch $("$py" -c 'import torch, transformers; print(torch.__version__, "/ transformers", transformers.__version__)'), 2 threads each"
echo "round  eager tok/s  torch.compile tok/s (ratio)  MegaTrain keep-all tok/s (ratio)  MegaTrain recompute tok/s (ratio)"
for round in $(seq 1 "$rounds"); do
  eager=$(OMP_NUM_THREADS=2 "$py" "$tmp/torch_peer.py" "$src" "$tmp/text.txt" "$steps" eager)
  compiled=$(OMP_NUM_THREADS=2 "$py" "$tmp/torch_peer.py" "$src" "$tmp/text.txt" "$steps" compile 2>/dev/null)
  "$exe" "$tmp/keep0.json" --data "$tmp/text.txt" --steps "$steps" --threads 2 --trace "$tmp/k0.mtrace" >/dev/null
  "$exe" "$tmp/keep1.json" --data "$tmp/text.txt" --steps "$steps" --threads 2 --trace "$tmp/k1.mtrace" >/dev/null
  k0=$(rate "$tmp/k0.mtrace")
  k1=$(rate "$tmp/k1.mtrace")
  "$py" -c "
t, c, a, b = map(float, '$eager $compiled $k0 $k1'.split())
print(f'{$round:5d}  {t:11.0f}  {c:19.0f} ({c / t:.2f}x)  {a:24.0f} ({a / t:.2f}x)  {b:25.0f} ({b / t:.2f}x)')"
done
