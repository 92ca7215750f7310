"""A tiny Llama written with plain torch.nn modules for the Python package's tests: Hugging Face's
Llama semantics (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU MLP) and parameter
names, and a config object with to_dict(), as a transformers PreTrainedModel has. Not transformers
code: written for these tests, like tests/python/torch_train_ref.py."""

import math

import torch
from torch import nn

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
    "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "vocab_size": 256,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


class Config:
    def __init__(self, values):
        self.__dict__.update(values)
        self._values = dict(values)

    def to_dict(self):
        return dict(self._values)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.h, self.kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)
        self.theta = c.rope_theta

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        inv = 1.0 / (self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d))
        freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.h // self.kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        o = torch.softmax(s, dim=-1) @ v
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.d))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Mlp(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TinyLlama(nn.Module):
    def __init__(self, values=CONFIG, seed=0):
        super().__init__()
        self.config = Config(values)
        self.model = Body(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.endswith("layernorm.weight") and name != "model.norm.weight":
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def train_reference(model, batches, lr, betas, eps, weight_decay, max_grad_norm):
    """Trains `model` in place as MegaTrain's plan says: per step, the micro-batches' summed
    cross-entropy (ignore_index -100, labels shifted as in transformers) over the step's counted
    targets; clipping to max_grad_norm; torch.optim.AdamW with decay on matrices and embeddings only.
    `batches`: per step, a list of (input_ids, labels) tensors of shape B x T. Returns the losses."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=eps)
    losses = []
    for step in batches:
        opt.zero_grad()
        counted = sum(int((labels[:, 1:] != -100).sum()) for _, labels in step)
        total = 0.0
        for ids, labels in step:
            logits = model(ids)
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                               ignore_index=-100, reduction="sum") / counted
            loss.backward()
            total += float(loss)
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(total)
    return losses
