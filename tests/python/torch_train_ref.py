#!/usr/bin/env python3
"""An independent PyTorch implementation of a Llama-family model (Llama, Mistral, Qwen2 layers as
Hugging Face defines them), written for MegaTrain's tests; not a test on its own.

Usage: torch_train_ref.py CONFIG.json INIT.safetensors TOKENS.u32 SPEC.json OURS.json OURS_FINAL.safetensors
It loads the initial weights, trains on the same sequential batches with torch.optim.AdamW, and
compares the per-step losses and the final weights with MegaTrain's. Exit 0 when they agree within
1e-4 relative, 1 otherwise, 77 when torch is missing."""
import json
import math
import struct
import sys

try:
    import torch
except ImportError:
    print("SKIP: PyTorch is not installed for /usr/bin/python3")
    sys.exit(77)

torch.set_num_threads(2)
cfg_path, init_path, tokens_path, spec_path, ours_path, final_path = sys.argv[1:7]
cfg = json.load(open(cfg_path))
spec = json.load(open(spec_path))
ours = json.load(open(ours_path))


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        assert e["dtype"] == "F32", e["dtype"]
        b, end = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:end]), dtype=torch.float32).reshape(e["shape"])
        out[name] = t.clone()
    return out


H = cfg["hidden_size"]
nh = cfg["num_attention_heads"]
nkv = cfg.get("num_key_value_heads", nh)
hd = cfg.get("head_dim") or H // nh
L = cfg["num_hidden_layers"]
eps = cfg.get("rms_norm_eps", 1e-6)
theta = cfg.get("rope_theta", 10000.0)
tied = cfg.get("tie_word_embeddings", False)
qkv_bias = cfg["architectures"][0] == "Qwen2ForCausalLM"

W = {k: torch.nn.Parameter(v) for k, v in read_safetensors(init_path).items()}


def rmsnorm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    return torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)


def forward(tokens, T):
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.outer(torch.arange(T).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    x = W["model.embed_tokens.weight"][tokens]
    Bsz = tokens.shape[0]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for l in range(L):
        p = f"model.layers.{l}."
        h = rmsnorm(x, W[p + "input_layernorm.weight"])
        def proj(name, n):
            y = h @ W[p + f"self_attn.{name}_proj.weight"].T
            if qkv_bias:
                y = y + W[p + f"self_attn.{name}_proj.bias"]
            return y.view(Bsz, T, n, hd).transpose(1, 2)
        q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        s = q @ k.transpose(2, 3) / math.sqrt(hd) + mask
        a = torch.softmax(s, dim=-1) @ v
        a = a.transpose(1, 2).reshape(Bsz, T, nh * hd)
        x = x + a @ W[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, W["model.norm.weight"])
    head = W["model.embed_tokens.weight"] if tied else W["lm_head.weight"]
    return x @ head.T


decay = [p for n, p in W.items() if p.dim() >= 2]
no_decay = [p for n, p in W.items() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec["weight_decay"]},
                         {"params": no_decay, "weight_decay": 0.0}],
                        lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]), eps=spec["eps"])
raw = open(tokens_path, "rb").read()
tokens = torch.tensor(struct.unpack(f"<{len(raw) // 4}I", raw), dtype=torch.int64)
T, B, A = spec["seq_len"], spec["micro_batch"], spec["grad_accum"]


def lr_at(step):
    if spec["warmup_steps"] > 0 and step < spec["warmup_steps"]:
        return spec["lr"] * (step + 1) / spec["warmup_steps"]
    span = max(1, spec["steps"] - 1 - spec["warmup_steps"])
    progress = min(max((step - spec["warmup_steps"]) / span, 0.0), 1.0)
    return spec["min_lr"] + (spec["lr"] - spec["min_lr"]) * 0.5 * (1 + math.cos(math.pi * progress))


losses = []
for step in range(spec["steps"]):
    for group in opt.param_groups:
        group["lr"] = lr_at(step)
    opt.zero_grad()
    total = 0.0
    for j in range(A):
        rows = [(step * A + j) * B + b for b in range(B)]
        x = torch.stack([tokens[r * T: r * T + T] for r in rows])
        y = torch.stack([tokens[r * T + 1: r * T + T + 1] for r in rows])
        logits = forward(x, T)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        (loss / A).backward()
        total += loss.item() / A
    if spec["clip_grad_norm"] > 0:
        torch.nn.utils.clip_grad_norm_(list(W.values()), spec["clip_grad_norm"])
    opt.step()
    losses.append(total)

ok = True
for s, (a, b) in enumerate(zip(ours["losses"], losses)):
    rel = abs(a - b) / abs(b)
    if rel > 1e-4:
        ok = False
        print(f"step {s}: loss MegaTrain {a:.7f} PyTorch {b:.7f} (relative {rel:.2e})")
final = read_safetensors(final_path)
worst = 0.0
for name, p in W.items():
    ref = p.detach()
    absdiff = (final[name] - ref).abs().max().item()
    diff = absdiff / max(ref.abs().max().item(), 1e-12)
    if name.endswith("k_proj.bias"):
        # Softmax is invariant to adding one vector to every key, and only RoPE's rotation breaks
        # that, so the k bias gradient is close to zero and dominated by rounding; Adam turns that
        # noise into full-size steps. Its bound is absolute: 1e-4 x the peak lr x the steps.
        bound = 1e-4 * spec["lr"] * spec["steps"]
        if absdiff > bound:
            ok = False
            print(f"{name}: final weights differ by {absdiff:.2e} absolute (bound {bound:.1e})")
        continue
    worst = max(worst, diff)
    if diff > 1e-4:
        ok = False
        print(f"{name}: final weights differ by {diff:.2e} relative")
print(f"losses MegaTrain {['%.6f' % v for v in ours['losses']]}")
print(f"losses PyTorch   {['%.6f' % v for v in losses]}")
print(f"worst final-weight difference {worst:.2e} (relative to each tensor's largest value)")
sys.exit(0 if ok else 1)
