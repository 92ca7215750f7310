#!/usr/bin/env python3
"""PyTorch reference for the CPU ops (kernels/cpu/), written after the Hugging Face Llama modeling
code: LlamaRMSNorm, LlamaRotaryEmbedding (+ the "linear" and "llama3" rope_scaling rules),
apply_rotary_pos_emb, repeat_kv + eager attention, LlamaMLP's silu(gate) * up, F.linear,
F.embedding and F.cross_entropy. Gradients come from torch autograd.

Usage: kernels_ref.py DIR, where DIR holds manifest.json and the raw arrays written by
tests/kernels_cpu/torch_reference_test.cpp (inputs, dout, and our outputs and gradients).
Each case is recomputed in its dtype (float64 or float32) and compared with
max|ours - torch| / max|torch| per output. Exit 0: all match; 1: a mismatch or no torch (named).
Not a test on its own (the C++ test and tests/python/test_kernels_vs_torch.py run it)."""
import json
import math
import os
import sys

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as e:
    print(f"FAIL: {e.name} is missing for {sys.executable} (scripts/python-env.sh installs requirements.txt)")
    sys.exit(1)

torch.set_num_threads(1)  # ctest runs two tests at once on two cores (docs/testing.md)

# Bounds on max|ours - torch| / max|torch|. float64: both sides round at 1.1e-16 per operation and
# sum in different orders over at most ~100 terms here (worst case ~1e-14, observed <= 4e-16); 1e-12
# leaves margin and is still 1e10 times tighter than any formula error. float32: the same argument
# at 6e-8 per operation (plus 1 ulp between torch's and glibc's cos/sin of HF's fp32 angles) gives a
# worst case of ~6e-6 and a typical 1e-7 (observed <= 2.4e-7); 1e-5 sits above the worst case.
BOUNDS = {"float64": 1e-12, "float32": 1e-5}


def load(d, spec):
    a = np.fromfile(os.path.join(d, spec["file"]), dtype="<" + spec["dtype"])
    return torch.from_numpy(a.reshape(spec["shape"]).copy())


# ---- HF semantics -------------------------------------------------------------------------------

def rmsnorm(x, w, eps):
    # LlamaRMSNorm.forward; HF upcasts to fp32, which is the identity for fp32 and is not applied to
    # float64 here (the float64 cases check the math, the float32 cases HF's precision).
    variance = x.pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + eps)
    return w * h


def rope_inv_freq(p, head_dim, dt):
    base = float(p["theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dt) / head_dim))
    kind = p.get("type", "default")
    if kind == "linear":
        inv_freq = inv_freq / p["factor"]
    elif kind == "llama3":
        factor = p["factor"]
        low_freq_factor = p["low_freq_factor"]
        high_freq_factor = p["high_freq_factor"]
        old_context_len = p["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    elif kind != "default":
        raise ValueError(kind)
    return inv_freq


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(x, positions, p):
    # x [n_tokens, heads, head_dim]; LlamaRotaryEmbedding.forward + apply_rotary_pos_emb.
    dt = x.dtype
    inv_freq = rope_inv_freq(p, x.shape[-1], dt)
    freqs = (inv_freq[:, None] @ positions.to(dt)[None, :]).transpose(0, 1)  # [n, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)


def repeat_kv(h, n_rep):
    b, nkv, t, d = h.shape
    if n_rep == 1:
        return h
    return h[:, :, None, :, :].expand(b, nkv, n_rep, t, d).reshape(b, nkv * n_rep, t, d)


def attention(q, k, v):
    # q [B, T, nh, hd], k/v [B, T, nkv, hd] (our layout) -> HF's [B, heads, T, hd] and back.
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scaling = q.shape[-1] ** -0.5
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    t = q.shape[2]
    mask = torch.full((t, t), torch.finfo(q.dtype).min, dtype=q.dtype).triu(1)
    w = w + mask
    probs = F.softmax(w, dim=-1, dtype=q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2)
    return out, probs


# ---- cases --------------------------------------------------------------------------------------

def run_case(c, a):
    """Returns {name: torch reference} for every output the case carries."""
    op, p = c["op"], c["params"]
    req = lambda t: t.clone().requires_grad_(True)  # noqa: E731
    if op == "embedding":
        table = req(a["table"])
        out = F.embedding(a["tokens"].long(), table)
        (dt,) = torch.autograd.grad(out, [table], a["dout"])
        return {"out": out, "dtable": dt}
    if op == "rmsnorm":
        x, w = req(a["x"]), req(a["w"])
        y = rmsnorm(x, w, p["eps"])
        dx, dw = torch.autograd.grad(y, [x, w], a["dout"])
        return {"y": y, "dx": dx, "dw": dw}
    if op == "rope":
        x = req(a["x"])
        y = rope(x, a["positions"], p)
        (dx,) = torch.autograd.grad(y, [x], a["dout"])
        return {"y": y, "dx": dx}
    if op == "linear":
        x, w = req(a["x"]), req(a["w"])
        inputs = [x, w]
        b = None
        if p["bias"]:
            b = req(a["b"])
            inputs.append(b)
        y = F.linear(x, w, b)
        grads = torch.autograd.grad(y, inputs, a["dout"])
        r = {"y": y, "dx": grads[0], "dw": grads[1]}
        if b is not None:
            r["db"] = grads[2]
        return r
    if op == "attention":
        q, k, v = req(a["q"]), req(a["k"]), req(a["v"])
        out, probs = attention(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, [q, k, v], a["dout"])
        return {"out": out, "probs": probs, "dq": dq, "dk": dk, "dv": dv}
    if op == "swiglu":
        g, u = req(a["gate"]), req(a["up"])
        out = F.silu(g) * u
        dg, du = torch.autograd.grad(out, [g, u], a["dout"])
        return {"out": out, "dgate": dg, "dup": du}
    if op == "cross_entropy":
        x = req(a["logits"])
        loss = F.cross_entropy(x, a["targets"].long(), ignore_index=p["ignore_index"], reduction="mean")
        (dx,) = torch.autograd.grad(loss, [x])
        return {"loss": loss.reshape(1), "dlogits": dx}
    if op == "sigmoid_route":
        # transformers' DeepseekV3TopkRouter after its logits: sigmoid scores, the bias for the choice
        # only, groups ranked by their two best biased scores, top-k within the open groups.
        z = req(a["logits"])
        groups, topk_group, k = p["n_group"], p["topk_group"], p["k"]
        scores = z.sigmoid()
        choice = scores + a["bias"]
        n, e = choice.shape
        group_scores = choice.view(n, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, groups, e // groups).reshape(-1, e)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        chosen = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
        # The weights in our slots' order (the experts compared as sets below).
        w = scores.gather(1, a["expert"].long())
        if p["renorm"]:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * p["scale"]
        (dz,) = torch.autograd.grad(w, [z], a["dweight"])
        return {"weight": w, "scores": scores, "expert_sorted": chosen.sort(dim=-1)[0].to(z.dtype), "dlogits": dz}
    raise ValueError(f"unknown op {op}")


def main():
    d = sys.argv[1]
    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    failures = 0
    print(f"{'case':<26} {'output':<8} {'max|ours-torch|/max|torch|':>27} {'bound':>8}")
    for c in manifest["cases"]:
        dt = getattr(torch, c["dtype"])
        arrays = {}
        for key, spec in c["arrays"].items():
            t = load(d, spec)
            arrays[key] = t.to(dt) if t.is_floating_point() else t
        ref = run_case(c, arrays)
        bound = BOUNDS[c["dtype"]]
        for key, r in ref.items():
            ours = arrays[key].to(torch.float64)
            r = r.detach().to(torch.float64)
            if ours.shape != r.shape:
                print(f"{c['name']:<26} {key:<8} shape {tuple(ours.shape)} vs torch {tuple(r.shape)}  FAIL")
                failures += 1
                continue
            scale = max(r.abs().max().item(), 1e-30)
            err = (ours - r).abs().max().item() / scale
            ok = err <= bound
            failures += 0 if ok else 1
            print(f"{c['name']:<26} {key:<8} {err:>27.2e} {bound:>8.0e}  {'ok' if ok else 'FAIL'}")
    print(f"torch {torch.__version__}: {'all outputs match' if failures == 0 else f'{failures} mismatches'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
