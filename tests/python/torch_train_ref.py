#!/usr/bin/env python3
"""An independent PyTorch implementation of a Llama-family model (Llama, Mistral, Qwen2 layers as
Hugging Face defines them), written for MegaTrain's tests; not a test on its own.

Usage: torch_train_ref.py DIR [--mutate SLIP [--slip-in reference|fp32]]
DIR holds config.json, init.safetensors, tokens.u32 (or batches.i32), spec.json and MegaTrain's results: ours.json
(per-step losses in fp32 and float64), final.safetensors (fp32, the streamed trainer) and
final64.safetensors (float64, the same layer templates in double). This script trains the same
model on the same sequential batches twice, in fp32 and in float64, with torch.optim.AdamW, and
checks:

  float64: MegaTrain's float64 run against PyTorch's float64 run. Both compute the same math with
    rounding near 1e-16, so any disagreement above F64_BOUND is a semantic difference.
  fp32: each side's fp32 error, measured against its own float64 run, as the relative 2-norm
    |a - b| / |b| of each tensor and of all weights together. MegaTrain's worst tensor must be
    within FP32_FACTOR times PyTorch's worst tensor, and all of its weights within FP32_FACTOR
    times all of PyTorch's. The bound therefore moves with the rounding spread of the machine,
    BLAS and instruction set it runs on; FP32_FACTOR is derived in docs/testing.md. (Per-tensor
    maxima, the old measure, are dominated by the few elements whose Adam step took its sign from
    rounding, a rare event whose count varies from tensor to tensor: their ratio has a heavy tail.)

With batches.i32 (supervised fine-tuning on a prepared dataset: issue 19) the batches are read from
it instead of cut from tokens.u32: for each step and micro-batch, B x T inputs then B x T targets
(int32), a target of -1 not counted. The loss of a step is then the sum of the counted targets'
cross-entropy over their number in the whole step (transformers' Trainer with num_items_in_batch),
and each micro-batch's backward takes its share of that sum.

--mutate SLIP trains the reference with one deliberate semantic slip, to show the checks catch it
(the exit status must then be 1). Exit 0 when everything agrees, 1 otherwise."""
import argparse
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

# float64 agreement: measured 1e-14..1e-12 (docs/testing.md); 1e-9 leaves three orders of magnitude
# for other machines' libm and summation orders, and is still ten million times below the smallest
# effect of the slips below.
F64_BOUND = 1e-9
# fp32: our error over PyTorch's (our worst tensor over PyTorch's worst, and all weights over all
# weights, in the 2-norm); measured at most 3.2 over 16 initial seeds, both models and every
# instruction-set path (docs/testing.md), so 8 leaves a factor of 2.5.
FP32_FACTOR = 8.0

SLIPS = {
    "rope_offset": "RoPE positions of the keys one ahead of the queries'",
    "rope_interleaved": "RoPE rotating adjacent pairs (GPT-J) instead of HF's halves",
    "rope_theta": "RoPE with a rope_theta other than the config's",
    "norm_eps": "RMSNorm with an epsilon other than the config's rms_norm_eps",
    "no_qkv_bias": "the q/k/v projection biases left out",
    "attention_scale": "attention scaled by 1/head_dim instead of 1/sqrt(head_dim)",
    "no_bias_correction": "AdamW without its bias correction",
    "decay_norms": "weight decay applied to norms and biases too",
    "untied_head_grad": "a tied head whose gradient does not reach the embedding",
}

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--mutate", choices=sorted(SLIPS), default=None)
ap.add_argument("--slip-in", choices=["reference", "fp32"], default="reference",
                help="reference: both PyTorch runs carry the slip (the float64 check must catch it); fp32: "
                     "MegaTrain's fp32 results are replaced by a PyTorch fp32 run with the slip, a stand-in "
                     "for a slip in the fp32 pipeline alone (the fp32 check must catch it)")
args = ap.parse_args()
if args.mutate:
    print(f"mutation: {args.mutate} ({SLIPS[args.mutate]}) in the {args.slip_in} side")

# One thread: ctest runs two tests at once on two cores, and OpenMP collapses when oversubscribed;
# 1 and 2 threads give the same bits at these sizes (docs/testing.md).
torch.set_num_threads(int(os.environ.get("MEGATRAIN_TORCH_THREADS", "1")))
d = args.dir
cfg = json.load(open(os.path.join(d, "config.json")))
spec = json.load(open(os.path.join(d, "spec.json")))
ours = json.load(open(os.path.join(d, "ours.json")))

DTYPES = {"F32": (torch.float32, 4), "F64": (torch.float64, 8)}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        dtype, _ = DTYPES[e["dtype"]]
        b, end = e["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[b:end]), dtype=dtype).reshape(e["shape"]).clone()
    return out


H = cfg["hidden_size"]
nh = cfg["num_attention_heads"]
nkv = cfg.get("num_key_value_heads", nh)
hd = cfg.get("head_dim") or H // nh
L = cfg["num_hidden_layers"]
tied = cfg.get("tie_word_embeddings", False)
qkv_bias = cfg["architectures"][0] == "Qwen2ForCausalLM"
slip, eps, theta = None, None, None


def set_slip(s):
    """The slip (or None) that the next training run carries."""
    global slip, eps, theta
    slip = s
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta", 10000.0)
    if slip == "norm_eps":
        eps = 1e-5 if eps != 1e-5 else 1e-6
    if slip == "rope_theta":
        theta = 500000.0 if theta != 500000.0 else 10000.0
init = read_safetensors(os.path.join(d, "init.safetensors"))
T, B, A = spec["seq_len"], spec["micro_batch"], spec["grad_accum"]
batches = None
if os.path.exists(os.path.join(d, "batches.i32")):
    raw = open(os.path.join(d, "batches.i32"), "rb").read()
    batches = torch.tensor(struct.unpack(f"<{len(raw) // 4}i", raw), dtype=torch.int64).reshape(spec["steps"], A, 2, B, T)
else:
    raw = open(os.path.join(d, "tokens.u32"), "rb").read()
    tokens = torch.tensor(struct.unpack(f"<{len(raw) // 4}I", raw), dtype=torch.int64)


def rmsnorm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    return torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)


def rope(x, pos, dtype):
    # HF: inv_freq from an int64 arange, cos/sin of positions x inv_freq, cast to x's dtype; in fp32
    # as HF computes it, in float64 for the float64 run (as our double kernels do).
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(torch.float64 if dtype == torch.float64
                                                                              else torch.float32) / hd))
    freqs = torch.outer(pos.to(inv_freq.dtype), inv_freq)
    if slip == "rope_interleaved":
        cos, sin = freqs.cos().repeat_interleave(2, -1)[None, None], freqs.sin().repeat_interleave(2, -1)[None, None]
        pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        return x * cos.to(dtype) + pairs * sin.to(dtype)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None].to(dtype), emb.sin()[None, None].to(dtype)
    return x * cos + rotate_half(x) * sin


def forward(W, tokens, dtype):
    x = W["model.embed_tokens.weight"][tokens]
    Bsz = tokens.shape[0]
    mask = torch.full((T, T), float("-inf"), dtype=dtype).triu(1)
    pos = torch.arange(T)
    scale = 1.0 / hd if slip == "attention_scale" else 1.0 / math.sqrt(hd)
    for l in range(L):
        p = f"model.layers.{l}."
        h = rmsnorm(x, W[p + "input_layernorm.weight"])

        def proj(name, n):
            y = h @ W[p + f"self_attn.{name}_proj.weight"].T
            if qkv_bias and slip != "no_qkv_bias":
                y = y + W[p + f"self_attn.{name}_proj.bias"]
            return y.view(Bsz, T, n, hd).transpose(1, 2)
        q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
        q = rope(q, pos, dtype)
        k = rope(k, pos + 1 if slip == "rope_offset" else pos, dtype)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        s = q @ k.transpose(2, 3) * scale + mask
        a = torch.softmax(s, dim=-1) @ v
        a = a.transpose(1, 2).reshape(Bsz, T, nh * hd)
        x = x + a @ W[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, W["model.norm.weight"])
    if tied:
        head = W["model.embed_tokens.weight"]
        if slip == "untied_head_grad":
            head = head.detach()
    else:
        head = W["lm_head.weight"]
    return x @ head.T


def lr_at(step):
    if spec["warmup_steps"] > 0 and step < spec["warmup_steps"]:
        return spec["lr"] * (step + 1) / spec["warmup_steps"]
    span = max(1, spec["steps"] - 1 - spec["warmup_steps"])
    progress = min(max((step - spec["warmup_steps"]) / span, 0.0), 1.0)
    return spec["min_lr"] + (spec["lr"] - spec["min_lr"]) * 0.5 * (1 + math.cos(math.pi * progress))


class AdamWWithoutBiasCorrection:
    """The slip no_bias_correction: AdamW's update with the raw moments."""

    def __init__(self, groups):
        self.param_groups = groups
        self.state = {}

    def zero_grad(self):
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                m, v = self.state.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p)))
                p.mul_(1 - g["lr"] * g["weight_decay"])
                m.mul_(spec["beta1"]).add_(p.grad, alpha=1 - spec["beta1"])
                v.mul_(spec["beta2"]).addcmul_(p.grad, p.grad, value=1 - spec["beta2"])
                p.addcdiv_(m, v.sqrt().add_(spec["eps"]), value=-g["lr"])


def train(dtype):
    W = {k: torch.nn.Parameter(v.to(dtype, copy=True)) for k, v in init.items()}
    decays = lambda n, p: p.dim() >= 2 or slip == "decay_norms"
    groups = [{"params": [p for n, p in W.items() if decays(n, p)], "weight_decay": spec["weight_decay"]},
              {"params": [p for n, p in W.items() if not decays(n, p)], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if slip == "no_bias_correction":
        opt = AdamWWithoutBiasCorrection(groups)  # each step sets every group's lr below
    else:
        opt = torch.optim.AdamW(groups, lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]), eps=spec["eps"])
    losses = []
    for step in range(spec["steps"]):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad()
        total = 0.0
        if batches is not None:
            counted = int((batches[step, :, 1] >= 0).sum())
        for j in range(A):
            if batches is not None:
                x, y = batches[step, j, 0], batches[step, j, 1]
                logits = forward(W, x, dtype)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-1,
                                                         reduction="sum")
                (loss / counted).backward()
                total += loss.item() / counted
                continue
            rows = [(step * A + j) * B + b for b in range(B)]
            x = torch.stack([tokens[r * T: r * T + T] for r in rows])
            y = torch.stack([tokens[r * T + 1: r * T + T + 1] for r in rows])
            logits = forward(W, x, dtype)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            (loss / A).backward()
            total += loss.item() / A
        if spec["clip_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(list(W.values()), spec["clip_grad_norm"])
        opt.step()
        losses.append(total)
    return losses, {k: p.detach() for k, p in W.items()}


def rel(a, b, scale):
    """The largest element difference of a and b over scale (the reference tensor's largest value), or
    over a's largest value where that is larger (a reference that stayed zero)."""
    return (a.double() - b.double()).abs().max().item() / max(scale, a.double().abs().max().item(), 1e-300)


def cached_train(dtype):
    """train(dtype) with the slip set, through the cache of PyTorch runs (ref_cache.py)."""
    return ref_cache.cached(d, [__file__], ("torch_train_ref", str(dtype), slip), lambda: train(dtype))


set_slip(args.mutate if args.slip_in == "reference" else None)
losses32, final32 = cached_train(torch.float32)
losses64, final64 = cached_train(torch.float64)
ours32 = read_safetensors(os.path.join(d, "final.safetensors"))
ours64 = read_safetensors(os.path.join(d, "final64.safetensors"))
if args.mutate and args.slip_in == "fp32":
    set_slip(args.mutate)
    ours["losses"], ours32 = cached_train(torch.float32)
ok = True

# ---- float64: semantics -------------------------------------------------------------------------
worst64_loss = max(abs(a - b) / abs(b) for a, b in zip(ours["losses64"], losses64))
worst64, worst64_name = 0.0, ""
for name, ref in final64.items():
    e = rel(ours64[name], ref, ref.abs().max().item())
    if e > worst64:
        worst64, worst64_name = e, name
    if e > F64_BOUND:
        ok = False
        print(f"float64 mismatch: {name}: final weights differ by {e:.2e} relative (bound {F64_BOUND:.0e})")
if worst64_loss > F64_BOUND:
    ok = False
    for s, (a, b) in enumerate(zip(ours["losses64"], losses64)):
        print(f"float64 mismatch: step {s}: loss MegaTrain {a:.15f} PyTorch {b:.15f}")
print(f"float64: worst loss difference {worst64_loss:.2e}, worst final-weight difference {worst64:.2e} ({worst64_name}),"
      f" bound {F64_BOUND:.0e}")

# ---- fp32: each side's error against its own float64 run ------------------------------------------
def rel_l2(a, b):
    """|a - b| / |b| in the 2-norm over the whole tensor: the bulk of the rounding, which the few
    elements whose Adam step took its sign from rounding cannot dominate as they do the maximum."""
    return (a.double() - b.double()).norm().item() / max(b.double().norm().item(), 1e-300)


err_ours, err_torch = {}, {}
for name, ref64 in final64.items():
    err_torch[name] = rel_l2(final32[name], ref64)
    err_ours[name] = rel_l2(ours32[name], ours64[name])
# Our worst tensor against PyTorch's worst tensor, and all weights at once against all weights.
torch_worst = max(err_torch.values())
allowed = FP32_FACTOR * torch_worst
for name in final64:
    if err_ours[name] > allowed:
        ok = False
        print(f"fp32 mismatch: {name}: MegaTrain's fp32 error {err_ours[name]:.2e} is above {FP32_FACTOR:g} x "
              f"PyTorch's worst tensor {torch_worst:.2e}")


def global_l2(run32, run64):
    num = sum((run32[n].double() - run64[n].double()).pow(2).sum().item() for n in final64)
    den = sum(run64[n].double().pow(2).sum().item() for n in final64)
    return math.sqrt(num / den)


all_ours, all_torch = global_l2(ours32, ours64), global_l2(final32, final64)
if all_ours > FP32_FACTOR * all_torch:
    ok = False
    print(f"fp32 mismatch: all weights: MegaTrain's fp32 error {all_ours:.2e} is above {FP32_FACTOR:g} x PyTorch's "
          f"{all_torch:.2e}")
worst_name = max(err_ours, key=err_ours.get)
worst_ratio = err_ours[worst_name] / torch_worst
# Losses: each step's fp32 loss against float64, the same rule over the ten steps.
loss_err_ours = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], ours["losses64"]))
loss_err_torch = max(abs(a - b) / abs(b) for a, b in zip(losses32, losses64))
if loss_err_ours > FP32_FACTOR * max(loss_err_torch, 1e-7):
    ok = False
    print(f"fp32 mismatch: losses: MegaTrain's fp32 error {loss_err_ours:.2e} is above {FP32_FACTOR:g} x PyTorch's {loss_err_torch:.2e}")
# The fp32 runs against each other: reported, and bounded by the triangle through float64.
direct = max(rel(ours32[n], final32[n], final64[n].abs().max().item()) for n in final64)
print(f"fp32: PyTorch's error worst tensor {torch_worst:.2e}, all weights {all_torch:.2e}; MegaTrain's worst tensor "
      f"{err_ours[worst_name]:.2e} ({worst_name}), all weights {all_ours:.2e}; ratios {worst_ratio:.2f} and "
      f"{all_ours / all_torch:.2f}, allowed {FP32_FACTOR:g}; loss error MegaTrain {loss_err_ours:.2e} PyTorch "
      f"{loss_err_torch:.2e}; fp32 runs differ by {direct:.2e} (largest element, relative)")
print(f"losses MegaTrain {['%.6f' % v for v in ours['losses']]}")
print(f"losses PyTorch   {['%.6f' % v for v in losses32]}")
sys.exit(0 if ok else 1)
