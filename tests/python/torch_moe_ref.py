#!/usr/bin/env python3
"""An independent PyTorch implementation of Qwen3ForCausalLM, Qwen3MoeForCausalLM and
MixtralForCausalLM, written from Hugging Face transformers' modeling code (modeling_qwen3.py,
modeling_qwen3_moe.py, modeling_mixtral.py and their load_balancing_loss_func, as of transformers
4.5x), for MegaTrain's tests; not a test on its own. Driven by tests/executor/torch_reference_test.cpp.

Usage: torch_moe_ref.py DIR
DIR holds what torch_train_ref.py reads (config.json, init.safetensors, tokens.u32, spec.json,
final.safetensors, final64.safetensors, ours.json), and for MoE models ours.json also has
"aux_losses" and "aux_losses64" (the load-balancing loss of each step, the mean over its
micro-batches) and "unused_experts" (per step, the (layer, expert) pairs no token chose).

Semantics, each as HF computes it:
  - Qwen3 attention: q_norm / k_norm are RMSNorms over head_dim applied to each head after the
    projections and before RoPE.
  - The MoE block: router logits = gate(x); p = softmax over all experts (float); top-k of p;
    weights renormalised (Mixtral always, Qwen3-MoE when norm_topk_prob); each expert, one
    nn.Linear triple per expert, runs only on the tokens that chose it (HF loops over the experts
    that were hit), and its output times the weight is added into the token's output with
    index_add_. An expert that no token of any micro-batch of the step chose therefore has
    grad None, and torch.optim.AdamW skips it (no decay, no moments, its step count unchanged).
  - Qwen3-MoE: layers in mlp_only_layers (or off the decoder_sparse_step) have the dense MLP.
  - load_balancing_loss_func: the router logits of the MoE layers concatenated ([layers*N, E]),
    routing_weights = softmax, expert_mask = one_hot(top-k) [rows, k, E], tokens_per_expert =
    mean over rows of the mask, router_prob_per_expert = mean over rows of the weights,
    loss = E * sum(tokens_per_expert * router_prob_per_expert). Added to the loss times
    router_aux_loss_coef when output_router_logits. With A micro-batches a step's objective is
    mean CE over the step's tokens + coef * mean over micro-batches of the aux loss.
  - AdamW parameter groups as torch_train_ref.py: tensors of two or more dimensions decay
    (weights, the router), one-dimensional ones (norms) do not.

Checks, as torch_train_ref.py: float64 against float64 within F64_BOUND (losses, aux losses, final
weights); fp32 each side's error against its own float64 run, ours within FP32_FACTOR times
PyTorch's. Plus: the routing really spreads over several experts (the load is printed), and the
unused-expert counts of both sides agree. Exit 0 when everything agrees, 1 otherwise, 77 when torch
is missing."""
import json
import math
import os
import struct
import sys

try:
    import torch
except ImportError:
    print("SKIP: PyTorch is not installed for /usr/bin/python3")
    sys.exit(77)

# The same bounds as torch_train_ref.py, for the same reasons (docs/testing.md).
F64_BOUND = 1e-9
FP32_FACTOR = 8.0

torch.set_num_threads(int(os.environ.get("MEGATRAIN_TORCH_THREADS", "2")))
d = sys.argv[1]
cfg = json.load(open(os.path.join(d, "config.json")))
spec = json.load(open(os.path.join(d, "spec.json")))
ours = json.load(open(os.path.join(d, "ours.json")))
arch = cfg["architectures"][0]


def read_safetensors(path):
    kinds = {"F32": torch.float32, "F64": torch.float64}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[b:end]), dtype=kinds[e["dtype"]]).reshape(e["shape"]).clone()
    return out


H = cfg["hidden_size"]
nh = cfg["num_attention_heads"]
nkv = cfg.get("num_key_value_heads", nh)
hd = cfg.get("head_dim") or H // nh
L = cfg["num_hidden_layers"]
eps = cfg.get("rms_norm_eps", 1e-6)
theta = cfg.get("rope_theta", 10000.0)
tied = cfg.get("tie_word_embeddings", False)
qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
if arch == "MixtralForCausalLM":
    E, K, renorm = cfg["num_local_experts"], cfg.get("num_experts_per_tok", 2), True
    moe_prefix, names = "block_sparse_moe", ("w1", "w3", "w2")  # gate, up, down
elif arch == "Qwen3MoeForCausalLM":
    E, K, renorm = cfg["num_experts"], cfg.get("num_experts_per_tok", 8), cfg.get("norm_topk_prob", False)
    moe_prefix, names = "mlp", ("gate_proj", "up_proj", "down_proj")
else:
    E, K, renorm, moe_prefix, names = 0, 0, False, None, None
coef = cfg.get("router_aux_loss_coef", 0.001) if cfg.get("output_router_logits", False) else 0.0


def is_moe_layer(l):
    if E == 0 or l in cfg.get("mlp_only_layers", []):
        return False
    step = cfg.get("decoder_sparse_step", 1)
    return step <= 1 or (l + 1) % step == 0


moe_layers = [l for l in range(L) if is_moe_layer(l)]
init = read_safetensors(os.path.join(d, "init.safetensors"))
raw = open(os.path.join(d, "tokens.u32"), "rb").read()
tokens = torch.tensor(struct.unpack(f"<{len(raw) // 4}I", raw), dtype=torch.int64)
T, B, A = spec["seq_len"], spec["micro_batch"], spec["grad_accum"]


def rmsnorm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(torch.float64 if dtype == torch.float64
                                                                              else torch.float32) / hd))
    freqs = torch.outer(pos.to(inv_freq.dtype), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None].to(dtype), emb.sin()[None, None].to(dtype)
    rot = torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)
    return x * cos + rot * sin


def moe_block(W, p, h, load):
    """HF's sparse MoE block on h [B, T, H]; returns the output and the router logits [B*T, E]."""
    x = h.reshape(-1, H)
    logits = x @ W[p + f"{moe_prefix}.gate.weight"].T
    probs = torch.softmax(logits, dim=1, dtype=torch.float32 if x.dtype == torch.float32 else torch.float64)
    weights, chosen = torch.topk(probs, K, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(chosen, num_classes=E).permute(2, 1, 0)  # [E, K, rows]
    for e in range(E):
        slot, rows = torch.where(mask[e])
        if rows.numel() == 0:
            continue  # HF runs only the experts that were hit
        load[e] += rows.numel()
        xe = x[rows]
        q = f"{moe_prefix}.experts.{e}."
        g = xe @ W[p + q + names[0] + ".weight"].T
        u = xe @ W[p + q + names[1] + ".weight"].T
        y = (torch.nn.functional.silu(g) * u) @ W[p + q + names[2] + ".weight"].T
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out.reshape(h.shape), logits


def aux_loss(router_logits):
    """load_balancing_loss_func without an attention mask."""
    if not router_logits:
        return None
    cat = torch.cat(router_logits, dim=0)
    routing = torch.softmax(cat, dim=-1)
    _, selected = torch.topk(routing, K, dim=-1)
    expert_mask = torch.nn.functional.one_hot(selected, E)
    tokens_per_expert = torch.mean(expert_mask.to(routing.dtype), dim=0)
    router_prob_per_expert = torch.mean(routing, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * E


def forward(W, toks, dtype, loads):
    x = W["model.embed_tokens.weight"][toks]
    Bsz = toks.shape[0]
    mask = torch.full((T, T), float("-inf"), dtype=dtype).triu(1)
    pos = torch.arange(T)
    router_logits = []
    for l in range(L):
        p = f"model.layers.{l}."
        h = rmsnorm(x, W[p + "input_layernorm.weight"])

        def proj(name, n):
            return (h @ W[p + f"self_attn.{name}_proj.weight"].T).view(Bsz, T, n, hd)
        q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
        if qk_norm:
            q = rmsnorm(q, W[p + "self_attn.q_norm.weight"])
            k = rmsnorm(k, W[p + "self_attn.k_norm.weight"])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q, pos, dtype), rope(k, pos, dtype)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        s = q @ k.transpose(2, 3) / math.sqrt(hd) + mask
        a = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(Bsz, T, nh * hd)
        x = x + a @ W[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"])
        if is_moe_layer(l):
            y, logits = moe_block(W, p, h, loads[l])
            router_logits.append(logits)
            x = x + y
        else:
            g = h @ W[p + "mlp.gate_proj.weight"].T
            u = h @ W[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(g) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, W["model.norm.weight"])
    head = W["model.embed_tokens.weight"] if tied else W["lm_head.weight"]
    return x @ head.T, aux_loss(router_logits)


def lr_at(step):
    if spec["warmup_steps"] > 0 and step < spec["warmup_steps"]:
        return spec["lr"] * (step + 1) / spec["warmup_steps"]
    span = max(1, spec["steps"] - 1 - spec["warmup_steps"])
    progress = min(max((step - spec["warmup_steps"]) / span, 0.0), 1.0)
    return spec["min_lr"] + (spec["lr"] - spec["min_lr"]) * 0.5 * (1 + math.cos(math.pi * progress))


def train(dtype):
    W = {k: torch.nn.Parameter(v.to(dtype, copy=True)) for k, v in init.items()}
    groups = [{"params": [p for p in W.values() if p.dim() >= 2], "weight_decay": spec["weight_decay"]},
              {"params": [p for p in W.values() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]),
                            eps=spec["eps"])
    losses, auxes, unused, loads_all = [], [], [], []
    for step in range(spec["steps"]):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        # set_to_none: an expert no token chose keeps grad None (PyTorch 2's default, what HF's
        # Trainer gets); 1.13's default would leave a zero tensor that AdamW then updates.
        opt.zero_grad(set_to_none=True)
        total, aux_total = 0.0, 0.0
        loads = [[0] * E for _ in range(L)]
        for j in range(A):
            rows = [(step * A + j) * B + b for b in range(B)]
            x = torch.stack([tokens[r * T: r * T + T] for r in rows])
            y = torch.stack([tokens[r * T + 1: r * T + T + 1] for r in rows])
            logits, aux = forward(W, x, dtype, loads)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            objective = loss / A
            if aux is not None:
                aux_total += aux.item() / A
                if coef:
                    objective = objective + coef * aux / A
            objective.backward()
            total += loss.item() / A
        if spec["clip_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_([p for p in W.values() if p.grad is not None], spec["clip_grad_norm"])
        opt.step()
        losses.append(total)
        auxes.append(aux_total)
        unused.append(sum(1 for l in moe_layers for e in range(E) if loads[l][e] == 0))
        loads_all.append(loads)
    return losses, auxes, unused, loads_all, {k: p.detach() for k, p in W.items()}


def rel(a, b, scale):
    return (a.double() - b.double()).abs().max().item() / max(scale, a.double().abs().max().item(), 1e-300)


def rel_l2(a, b):
    return (a.double() - b.double()).norm().item() / max(b.double().norm().item(), 1e-300)


losses32, aux32, unused32, _, final32 = train(torch.float32)
losses64, aux64, unused64, loads64, final64 = train(torch.float64)
ours32 = read_safetensors(os.path.join(d, "final.safetensors"))
ours64 = read_safetensors(os.path.join(d, "final64.safetensors"))
ok = True

# ---- the case is a real one: routing spreads over several experts ----------------------------------
if E:
    first = loads64[0]
    for l in moe_layers:
        busy = sum(1 for c in first[l] if c > 0)
        print(f"layer {l}: tokens per expert in step 0 {first[l]} ({busy} of {E} experts used)")
        if busy < min(E, 3):
            ok = False
            print(f"routing does not spread: layer {l} uses {busy} experts")
    print(f"unused (layer, expert) pairs per step: PyTorch {unused64}, MegaTrain {ours['unused_experts']}")
    if unused64 != ours["unused_experts"]:
        ok = False
        print("mismatch: the steps leave different experts unused")

# ---- float64: semantics -------------------------------------------------------------------------
def worst_rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-300) for x, y in zip(a, b))


worst64_loss = worst_rel(ours["losses64"], losses64)
if worst64_loss > F64_BOUND:
    ok = False
    for s, (a, b) in enumerate(zip(ours["losses64"], losses64)):
        print(f"float64 mismatch: step {s}: loss MegaTrain {a:.15f} PyTorch {b:.15f}")
worst64_aux = 0.0
if E:
    worst64_aux = worst_rel(ours["aux_losses64"], aux64)
    if worst64_aux > F64_BOUND:
        ok = False
        for s, (a, b) in enumerate(zip(ours["aux_losses64"], aux64)):
            print(f"float64 mismatch: step {s}: aux loss MegaTrain {a:.15f} PyTorch {b:.15f}")
worst64, worst64_name = 0.0, ""
for name, ref in final64.items():
    e = rel(ours64[name], ref, ref.abs().max().item())
    if e > worst64:
        worst64, worst64_name = e, name
    if e > F64_BOUND:
        ok = False
        print(f"float64 mismatch: {name}: final weights differ by {e:.2e} relative (bound {F64_BOUND:.0e})")
print(f"float64: worst loss difference {worst64_loss:.2e}, aux loss {worst64_aux:.2e}, worst final-weight difference "
      f"{worst64:.2e} ({worst64_name}), bound {F64_BOUND:.0e}")

# ---- fp32: each side's error against its own float64 run ------------------------------------------
err_ours = {n: rel_l2(ours32[n], ours64[n]) for n in final64}
err_torch = {n: rel_l2(final32[n], final64[n]) for n in final64}
torch_worst = max(err_torch.values())
for n in final64:
    if err_ours[n] > FP32_FACTOR * torch_worst:
        ok = False
        print(f"fp32 mismatch: {n}: MegaTrain's fp32 error {err_ours[n]:.2e} is above {FP32_FACTOR:g} x PyTorch's worst "
              f"tensor {torch_worst:.2e}")
loss_err_ours = worst_rel(ours["losses"], ours["losses64"])
loss_err_torch = worst_rel(losses32, losses64)
if loss_err_ours > FP32_FACTOR * max(loss_err_torch, 1e-7):
    ok = False
    print(f"fp32 mismatch: losses: MegaTrain's fp32 error {loss_err_ours:.2e} is above {FP32_FACTOR:g} x PyTorch's "
          f"{loss_err_torch:.2e}")
worst_name = max(err_ours, key=err_ours.get)
print(f"fp32: PyTorch's worst tensor error {torch_worst:.2e}; MegaTrain's {err_ours[worst_name]:.2e} ({worst_name}); "
      f"loss error MegaTrain {loss_err_ours:.2e} PyTorch {loss_err_torch:.2e}")
print(f"losses MegaTrain {['%.6f' % v for v in ours['losses']]}")
print(f"losses PyTorch   {['%.6f' % v for v in losses32]}")
if E:
    print(f"aux losses MegaTrain {['%.6f' % v for v in ours['aux_losses']]}")
    print(f"aux losses PyTorch   {['%.6f' % v for v in aux32]}")
sys.exit(0 if ok else 1)
