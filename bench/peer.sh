#!/usr/bin/env bash
# The CPU backend against PyTorch eager on the same training step (issue 21), interleaved in one run:
# small-llama (4.6M parameters), seq 128, micro-batch 4, grad_accum 4, fp32, clipping 1.0, AdamW,
# two threads each. PyTorch trains python/tests/tiny_torch_llama.py's Llama (Hugging Face's
# semantics, naive attention, torch.optim.AdamW) built from profiles/models/small-llama.json;
# megatrain-exec trains the same model and batch shape with every state in RAM, once keeping every
# activation (checkpoint_every 0, the same arithmetic as eager PyTorch) and once recomputing from
# per-layer checkpoints (checkpoint_every 1). Prints tokens/s over the steps after the first, per
# round, and the ratios (>1: MegaTrain is faster).
#   bench/peer.sh [build-dir] [steps] [rounds]
set -euo pipefail
build=${1:-build}
steps=${2:-8}
rounds=${3:-2}
exe=$build/bin/megatrain-exec
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat /usr/share/common-licenses/* >"$tmp/text.txt"
/usr/bin/python3 - "$src/profiles/plans/tiny-cpu.json" "$tmp" <<'PY'
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
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1] + '/python/tests')
from tiny_torch_llama import TinyLlama
torch.set_num_threads(2)
steps, text = int(sys.argv[3]), open(sys.argv[2], 'rb').read()
config = json.load(open(sys.argv[1] + '/profiles/models/small-llama.json'))
model = TinyLlama(config)
B, T, A = 4, 128, 4
tokens = torch.tensor(list(text[: (steps * A * B + 1) * T + 1]), dtype=torch.long)
decay = [p for p in model.parameters() if p.dim() >= 2]
rest = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': rest, 'weight_decay': 0.0}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
times = []
for s in range(steps):
    t0 = time.perf_counter()
    opt.zero_grad()
    for j in range(A):
        rows = torch.stack([tokens[((s * A + j) * B + b) * T:((s * A + j) * B + b) * T + T + 1] for b in range(B)])
        logits = model(rows[:, :T])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction='sum') / (A * B * T)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    times.append(time.perf_counter() - t0)
print(A * B * T * (steps - 1) / sum(times[1:]))
PY
rate() {  # megatrain-exec's tokens/s over the steps after the first, from its trace
  /usr/bin/python3 -c "
import sqlite3, sys
rows = sqlite3.connect(sys.argv[1]).execute('select tokens, time_s from steps where step > 0').fetchall()
print(sum(t for t, _ in rows) / sum(s for _, s in rows))" "$1"
}
echo "round  PyTorch tok/s  MegaTrain keep-all tok/s (ratio)  MegaTrain recompute tok/s (ratio)"
for round in $(seq 1 "$rounds"); do
  torch=$(OMP_NUM_THREADS=2 /usr/bin/python3 "$tmp/torch_peer.py" "$src" "$tmp/text.txt" "$steps")
  "$exe" "$tmp/keep0.json" --data "$tmp/text.txt" --steps "$steps" --threads 2 --trace "$tmp/k0.mtrace" >/dev/null
  "$exe" "$tmp/keep1.json" --data "$tmp/text.txt" --steps "$steps" --threads 2 --trace "$tmp/k1.mtrace" >/dev/null
  k0=$(rate "$tmp/k0.mtrace")
  k1=$(rate "$tmp/k1.mtrace")
  /usr/bin/python3 -c "
t, a, b = map(float, '$torch $k0 $k1'.split())
print(f'{$round:5d}  {t:13.0f}  {a:24.0f} ({a / t:.2f}x)  {b:24.0f} ({b / t:.2f}x)')"
done
