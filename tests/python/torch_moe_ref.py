#!/usr/bin/env python3
"""An independent PyTorch implementation of Qwen3ForCausalLM, Qwen3MoeForCausalLM,
MixtralForCausalLM and GptOssForCausalLM, written from Hugging Face transformers' modeling code
(modeling_qwen3.py, modeling_qwen3_moe.py, modeling_mixtral.py, modeling_gpt_oss.py, their
load_balancing_loss_func, masking_utils' sliding window and modeling_rope_utils' yarn, as of
transformers 4.5x), for MegaTrain's tests; not a test on its own. Driven by
tests/executor/torch_reference_test.cpp.

Usage: torch_moe_ref.py DIR [--mutate SLIP]
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
  - gpt-oss: q/k/v/o biases; one learned sink logit per head joins every attention row's softmax
    (cat([scores, sink]) - max, softmax, the sink's column dropped); layers that layer_types marks
    "sliding_attention" see keys j > i - sliding_window only; yarn RoPE (the frequency ramp
    between the beta_fast/beta_slow correction range, cos and sin times the attention factor);
    the router is a Linear with bias, top-k of its logits, softmax over the k values; the experts
    are stacked tensors used as x @ W + b (gate_up_proj [E, H, 2I], gate and up interleaved in its
    columns; down_proj [E, I, H]); the clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate) with
    gate clamped above at limit and up to [-limit, limit]. Being stacked, an expert no token chose
    still has a (zero) gradient slice and AdamW updates the whole tensor. The aux loss is taken
    on the router's logits.
  - load_balancing_loss_func: the router logits of the MoE layers concatenated ([layers*N, E]),
    routing_weights = softmax, expert_mask = one_hot(top-k) [rows, k, E], tokens_per_expert =
    mean over rows of the mask, router_prob_per_expert = mean over rows of the weights,
    loss = E * sum(tokens_per_expert * router_prob_per_expert). Added to the loss times
    router_aux_loss_coef when output_router_logits. With A micro-batches a step's objective is
    mean CE over the step's tokens + coef * the sum over micro-batches of the aux loss, as Hugging
    Face's Trainer computes it (a loss normalised by num_items_in_batch is not divided by A).
  - AdamW parameter groups by HF Trainer's name rule: a parameter decays unless its name has
    "bias" or is a norm's ("norm" in the name); gpt-oss's sinks decay, its stacked biases do not.

--mutate SLIP trains the reference (float64 only) with one deliberate semantic slip (SLIPS below),
to show that the float64 check catches it: the script must then exit 1 with a "float64 mismatch".

Checks, as torch_train_ref.py: float64 against float64 within F64_BOUND (losses, aux losses, final
weights); fp32 each side's error against its own float64 run, ours within FP32_FACTOR times
PyTorch's. Plus: the routing really spreads over several experts (the load is printed), and the
unused-expert counts of both sides agree. Exit 0 when everything agrees, 1 otherwise (a missing torch included)."""
import json
import math
import os
import struct
import sys

try:
    import torch
except ImportError as e:
    print(f"FAIL: {e.name} is missing for {sys.executable} (scripts/python-env.sh installs requirements.txt)")
    sys.exit(1)

import ref_cache  # noqa: E402 (after the check for PyTorch, which it imports)

# The same bounds as torch_train_ref.py, for the same reasons (docs/testing.md).
F64_BOUND = 1e-9
FP32_FACTOR = 8.0

# One thread: ctest runs two tests at once on two cores (docs/testing.md).
torch.set_num_threads(int(os.environ.get("MEGATRAIN_TORCH_THREADS", "1")))
SLIPS = {
    "no_sinks": "attention without gpt-oss's sink logits",
    "no_window": "every layer attends to the whole causal prefix",
    "window_off_by_one": "the sliding window keeps one key too many (j >= i - window)",
    "yarn_no_scale": "yarn without the attention factor on cos and sin",
    "yarn_no_ramp": "yarn's frequencies all interpolated (no ramp)",
    "no_clamp": "the SwiGLU without gpt-oss's clamp",
    "gate_up_halves": "gate and up as the two halves of gate_up_proj instead of interleaved",
    "no_expert_bias": "the experts without their biases",
    "no_o_bias": "o_proj without its bias",
    "no_renorm": "the router's top-k weights not renormalised (softmax over all experts)",
    "sinks_no_decay": "the sinks kept out of weight decay",
    "aux_on_weights": "the aux loss on the routing weights instead of the logits",
}
SLIP = None
if "--mutate" in sys.argv:
    SLIP = sys.argv[sys.argv.index("--mutate") + 1]
    if SLIP not in SLIPS:
        print(f"unknown slip {SLIP}; accepted: {', '.join(SLIPS)}")
        sys.exit(2)
    print(f"mutation: {SLIP} ({SLIPS[SLIP]})")
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
elif arch == "GptOssForCausalLM":
    E, K, renorm = cfg["num_local_experts"], cfg.get("num_experts_per_tok", 4), True
    moe_prefix, names = "mlp", None
else:
    E, K, renorm, moe_prefix, names = 0, 0, False, None, None
gpt_oss = arch == "GptOssForCausalLM"
attn_bias = cfg.get("attention_bias", False)
window = cfg.get("sliding_window") or 0
layer_types = cfg.get("layer_types") or (["sliding_attention"] * L if window and not gpt_oss else ["full_attention"] * L)
rope_scaling = cfg.get("rope_scaling") or {}
ALPHA, LIMIT = 1.702, cfg.get("swiglu_limit", 7.0)
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


def inv_freq_and_scale(dtype):
    """HF's default and yarn inv_freq (the latter from _compute_yarn_parameters) and the factor on cos/sin."""
    ft = torch.float64 if dtype == torch.float64 else torch.float32
    pos_freqs = theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(ft) / hd)
    if rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return 1.0 / pos_freqs, 1.0
    factor = rope_scaling["factor"]
    omax = rope_scaling.get("original_max_position_embeddings", cfg["max_position_embeddings"])
    scale = rope_scaling.get("attention_factor") or (1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0)
    if SLIP == "yarn_no_scale":
        scale = 1.0
    if SLIP == "yarn_no_ramp":
        return 1.0 / (factor * pos_freqs), scale

    def corr(rot):
        return hd * math.log(omax / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = corr(rope_scaling.get("beta_fast") or 32), corr(rope_scaling.get("beta_slow") or 1)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(hd // 2, dtype=ft) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra, scale


def rope(x, pos, dtype):
    inv_freq, scale = inv_freq_and_scale(dtype)
    freqs = torch.outer(pos.to(inv_freq.dtype), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scale)[None, None].to(dtype), (emb.sin() * scale)[None, None].to(dtype)
    rot = torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)
    return x * cos + rot * sin


def gpt_oss_block(W, p, h, load):
    """GptOssMLP as HF trains it: the router, then a loop over the experts that were hit."""
    x = h.reshape(-1, H)
    logits = x @ W[p + "mlp.router.weight"].T + W[p + "mlp.router.bias"]
    top, chosen = torch.topk(logits, K, dim=-1)
    top = torch.softmax(top, dim=1, dtype=top.dtype)
    if SLIP == "no_renorm":
        top = torch.softmax(logits, dim=1).gather(1, chosen)
    scores = torch.zeros_like(logits).scatter_(1, chosen, top)
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(chosen, num_classes=E).permute(2, 1, 0)
    gu_w, gu_b = W[p + "mlp.experts.gate_up_proj"], W[p + "mlp.experts.gate_up_proj_bias"]
    dn_w, dn_b = W[p + "mlp.experts.down_proj"], W[p + "mlp.experts.down_proj_bias"]
    for e in range(E):
        _, rows = torch.where(mask[e])
        if rows.numel() == 0:
            continue
        load[e] += rows.numel()
        gu = x[rows] @ gu_w[e] + (0 if SLIP == "no_expert_bias" else gu_b[e])
        gate, up = gu[..., ::2], gu[..., 1::2]
        if SLIP == "gate_up_halves":
            gate, up = gu[..., : gu.shape[-1] // 2], gu[..., gu.shape[-1] // 2:]
        if SLIP != "no_clamp":
            gate = gate.clamp(min=None, max=LIMIT)
            up = up.clamp(min=-LIMIT, max=LIMIT)
        glu = gate * torch.sigmoid(gate * ALPHA)
        y = ((up + 1) * glu) @ dn_w[e] + (0 if SLIP == "no_expert_bias" else dn_b[e])
        out.index_add_(0, rows, y * scores[rows, e, None])
    return out.reshape(h.shape), (scores if SLIP == "aux_on_weights" else logits)


def moe_block(W, p, h, load):
    """HF's sparse MoE block on h [B, T, H]; returns the output and the router logits [B*T, E]."""
    x = h.reshape(-1, H)
    logits = x @ W[p + f"{moe_prefix}.gate.weight"].T
    probs = torch.softmax(logits, dim=1, dtype=torch.float32 if x.dtype == torch.float32 else torch.float64)
    weights, chosen = torch.topk(probs, K, dim=-1)
    if renorm and SLIP != "no_renorm":
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
    causal = torch.full((T, T), float("-inf"), dtype=dtype).triu(1)
    i_idx, j_idx = torch.arange(T)[:, None], torch.arange(T)[None, :]
    drop = (j_idx < i_idx - window) if SLIP == "window_off_by_one" else (j_idx <= i_idx - window)
    sliding = causal.masked_fill(drop, float("-inf")) if window and SLIP != "no_window" else causal
    pos = torch.arange(T)
    router_logits = []
    for l in range(L):
        p = f"model.layers.{l}."
        h = rmsnorm(x, W[p + "input_layernorm.weight"])

        def proj(name, n):
            y = h @ W[p + f"self_attn.{name}_proj.weight"].T
            if attn_bias:
                y = y + W[p + f"self_attn.{name}_proj.bias"]
            return y.view(Bsz, T, n, hd)
        q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
        if qk_norm:
            q = rmsnorm(q, W[p + "self_attn.q_norm.weight"])
            k = rmsnorm(k, W[p + "self_attn.k_norm.weight"])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q, pos, dtype), rope(k, pos, dtype)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        mask = sliding if layer_types[l] == "sliding_attention" else causal
        s = q @ k.transpose(2, 3) * hd ** -0.5 + mask
        if gpt_oss and SLIP != "no_sinks":  # the sink's logit joins the softmax, its column then dropped
            sink = W[p + "self_attn.sinks"].reshape(1, -1, 1, 1).expand(Bsz, -1, T, -1)
            comb = torch.cat([s, sink], dim=-1)
            comb = comb - comb.max(dim=-1, keepdim=True).values
            probs = torch.softmax(comb, dim=-1, dtype=comb.dtype)[..., :-1]
        else:
            probs = torch.softmax(s, dim=-1)
        a = (probs @ v).transpose(1, 2).reshape(Bsz, T, nh * hd)
        o = a @ W[p + "self_attn.o_proj.weight"].T
        if attn_bias and SLIP != "no_o_bias":
            o = o + W[p + "self_attn.o_proj.bias"]
        x = x + o
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"])
        if is_moe_layer(l):
            y, logits = (gpt_oss_block if gpt_oss else moe_block)(W, p, h, loads[l])
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
    def decays(name):  # HF Trainer: no decay for biases and norms
        if SLIP == "sinks_no_decay" and name.endswith("sinks"):
            return False
        return "bias" not in name and "norm" not in name
    groups = [{"params": [p for n, p in W.items() if decays(n)], "weight_decay": spec["weight_decay"]},
              {"params": [p for n, p in W.items() if not decays(n)], "weight_decay": 0.0}]
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
                    objective = objective + coef * aux
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


def cached_train(dtype):
    """train(dtype) with SLIP, through the cache of PyTorch runs (ref_cache.py)."""
    return ref_cache.cached(d, [__file__], ("torch_moe_ref", str(dtype), SLIP), lambda: train(dtype))


losses64, aux64, unused64, loads64, final64 = cached_train(torch.float64)
if SLIP:  # only the float64 check is asked to catch a slip; the fp32 runs are skipped
    losses32, aux32, final32 = losses64, aux64, final64
else:
    losses32, aux32, unused32, _, final32 = cached_train(torch.float32)
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
if not SLIP:
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
