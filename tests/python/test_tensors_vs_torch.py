#!/usr/bin/env python3
"""Independent check of ModelSpec: builds each profile's module tree in PyTorch (on the meta
device, so 123B models cost no memory), following the HF modeling code's structure, and compares
state-dict names, shapes and the unique parameter count with `megatrain-plan inspect --tensors --json`.
Usage: test_tensors_vs_torch.py BUILD_DIR SOURCE_DIR. A missing PyTorch is a failure naming it."""
import json
import os
import subprocess
import sys

try:
    import torch
    from torch import nn
except ImportError as e:
    print(f"FAIL: {e.name} is missing for {sys.executable} (scripts/python-env.sh installs requirements.txt)")
    sys.exit(1)

build_dir, source_dir = sys.argv[1], sys.argv[2]
plan = os.path.join(build_dir, "bin", "megatrain-plan")
models_dir = os.path.join(source_dir, "profiles", "models")


def linear(i, o, bias):
    return nn.Linear(i, o, bias=bias, device="meta")


class RMSNorm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(h, device="meta"))


class Attention(nn.Module):
    def __init__(self, c, qkv_bias, o_bias):
        super().__init__()
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv = c.get("num_key_value_heads", c["num_attention_heads"])
        h = c["hidden_size"]
        self.q_proj = linear(h, c["num_attention_heads"] * hd, qkv_bias)
        self.k_proj = linear(h, kv * hd, qkv_bias)
        self.v_proj = linear(h, kv * hd, qkv_bias)
        self.o_proj = linear(c["num_attention_heads"] * hd, h, o_bias)
        arch = c["architectures"][0]
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):  # Qwen3Attention: per-head norms
            self.q_norm = RMSNorm(hd)
            self.k_norm = RMSNorm(hd)
        if arch == "GptOssForCausalLM":  # GptOssAttention: a learned sink logit per head
            self.sinks = nn.Parameter(torch.empty(c["num_attention_heads"], device="meta"))


class MLP(nn.Module):
    def __init__(self, c, bias):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = linear(h, i, bias)
        self.up_proj = linear(h, i, bias)
        self.down_proj = linear(i, h, bias)


class Expert(nn.Module):
    """One expert of Mixtral (w1 gate, w2 down, w3 up) or Qwen3-MoE (gate/up/down_proj)."""
    def __init__(self, h, i, mixtral):
        super().__init__()
        if mixtral:
            self.w1, self.w2, self.w3 = linear(h, i, False), linear(i, h, False), linear(h, i, False)
        else:
            self.gate_proj, self.up_proj, self.down_proj = linear(h, i, False), linear(h, i, False), linear(i, h, False)


class SparseMoe(nn.Module):
    """MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: a router `gate` and a list of experts."""
    def __init__(self, c, mixtral):
        super().__init__()
        e = c["num_local_experts"] if mixtral else c["num_experts"]
        i = c["intermediate_size"] if mixtral else c["moe_intermediate_size"]
        self.gate = linear(c["hidden_size"], e, False)
        self.experts = nn.ModuleList([Expert(c["hidden_size"], i, mixtral) for _ in range(e)])


class GptOssExperts(nn.Module):
    def __init__(self, c):
        super().__init__()
        e, h, i = c["num_local_experts"], c["hidden_size"], c["intermediate_size"]
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i, device="meta"))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i, device="meta"))
        self.down_proj = nn.Parameter(torch.empty(e, i, h, device="meta"))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h, device="meta"))


class GptOssMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.router = linear(c["hidden_size"], c["num_local_experts"], True)
        self.experts = GptOssExperts(c)


class Layer(nn.Module):
    def __init__(self, c, qkv_bias, o_bias, mlp_bias, index):
        super().__init__()
        self.self_attn = Attention(c, qkv_bias, o_bias)
        arch = c["architectures"][0]
        step = c.get("decoder_sparse_step", 1)
        if arch == "MixtralForCausalLM":
            self.block_sparse_moe = SparseMoe(c, True)
        elif arch == "GptOssForCausalLM":
            self.mlp = GptOssMLP(c)
        elif arch == "Qwen3MoeForCausalLM" and index not in c.get("mlp_only_layers", []) and (step <= 1 or (index + 1) % step == 0):
            self.mlp = SparseMoe(c, False)
        else:
            self.mlp = MLP(c, mlp_bias)
        self.input_layernorm = RMSNorm(c["hidden_size"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"])


class Inner(nn.Module):
    def __init__(self, c, biases):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"], device="meta")
        self.layers = nn.ModuleList([Layer(c, *biases, l) for l in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"])


class CausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        arch = c["architectures"][0]
        if arch == "Qwen2ForCausalLM":
            biases = (True, False, False)
        elif arch == "LlamaForCausalLM":
            ab = c.get("attention_bias", False)
            biases = (ab, ab, c.get("mlp_bias", False))
        elif arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"):
            ab = c.get("attention_bias", arch == "GptOssForCausalLM")
            biases = (ab, ab, False)
        else:
            biases = (False, False, False)
        self.model = Inner(c, biases)
        self.lm_head = linear(c["hidden_size"], c["vocab_size"], False)
        if c.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight


failures = 0
names = sorted(f[:-5] for f in os.listdir(models_dir) if f.endswith(".json"))
for name in names:
    with open(os.path.join(models_dir, name + ".json")) as f:
        cfg = json.load(f)
    ref = CausalLM(cfg)
    # state_dict() drops nothing; a tied head appears twice in it but is one parameter.
    ref_tensors = [(k, list(v.shape)) for k, v in ref.state_dict().items()]
    if cfg.get("tie_word_embeddings", False):
        ref_tensors = [t for t in ref_tensors if t[0] != "lm_head.weight"]
    ref_total = sum(p.numel() for p in ref.parameters())  # parameters() yields shared ones once
    out = subprocess.run([plan, "inspect", "--model", name, "--tensors", "--json"],
                         capture_output=True, text=True, check=True)
    ours = json.loads(out.stdout)
    our_tensors = [(t["name"], t["shape"]) for t in ours["tensors"]]
    ok = True
    if sorted(our_tensors) != sorted(ref_tensors):
        ok = False
        missing = set(map(str, ref_tensors)) - set(map(str, our_tensors))
        extra = set(map(str, our_tensors)) - set(map(str, ref_tensors))
        print(f"FAIL {name}: tensor lists differ; missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
    if [t[0] for t in our_tensors] != [t[0] for t in ref_tensors]:
        ok = False
        print(f"FAIL {name}: tensor order differs from the PyTorch state_dict order")
    if ours["parameters"] != ref_total:
        ok = False
        print(f"FAIL {name}: parameters {ours['parameters']} != PyTorch {ref_total}")
    print(("ok  " if ok else "FAIL") + f" {name}: {len(our_tensors)} tensors, {ref_total:,} parameters")
    failures += 0 if ok else 1
sys.exit(1 if failures else 0)
