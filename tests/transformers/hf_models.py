"""The architectures MegaTrain trains, built by transformers itself with random weights, and a
training loop with Hugging Face Trainer's semantics: the reference side of tests/transformers.

Each model is small (2 to 3 layers, hidden 64, vocabulary 160) but sets what differs between the
architectures: grouped-query attention, q/k/v biases, a tied head, QK-norm and a head_dim that is not
hidden / heads, sliding windows, attention sinks, dense layers among MoE ones (mlp_only_layers), the
top-k variants (renormalised or not) and the router's load-balancing loss in the objective.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Callable, Dict, List, Tuple

import torch
import transformers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 160
SEQ = 24

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-6, initializer_range=0.05, attn_implementation="eager", experts_implementation="eager", bos_token_id=1, eos_token_id=2)


def _llama():
    return transformers.LlamaConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, rope_theta=10000.0,
                                    tie_word_embeddings=False)


def _mistral():
    # A window shorter than the rows: the window's mask is exercised.
    return transformers.MistralConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, rope_theta=10000.0,
                                      sliding_window=9, tie_word_embeddings=False)


def _qwen2():
    # q/k/v biases (always, in Qwen2) and a tied head.
    return transformers.Qwen2Config(**COMMON, intermediate_size=96, num_hidden_layers=2, rope_theta=1000000.0,
                                    tie_word_embeddings=True, use_sliding_window=False)


def _qwen3():
    # QK-norm, and a head_dim (24) that is not hidden / heads (16).
    return transformers.Qwen3Config(**COMMON, intermediate_size=96, num_hidden_layers=2, head_dim=24, rope_theta=1000000.0,
                                    tie_word_embeddings=True, use_sliding_window=False)


def _qwen3_moe():
    # A dense first layer (mlp_only_layers), 8 experts of which 2 per token, renormalised top-k, the
    # load-balancing loss in the objective.
    return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                                       head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                       decoder_sparse_step=1, mlp_only_layers=[0], output_router_logits=True,
                                       router_aux_loss_coef=0.02, tie_word_embeddings=False, use_sliding_window=False)


def _mixtral():
    return transformers.MixtralConfig(**COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
                                      rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False)


def _gpt_oss():
    # Attention sinks, sliding and full layers alternating, q/k/v/o biases, a biased router, the
    # clamped SwiGLU; MoE in every layer.
    c = dict(COMMON, num_key_value_heads=2)
    return transformers.GptOssConfig(**c, intermediate_size=32, num_hidden_layers=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=9,
                                     layer_types=["sliding_attention", "full_attention"], output_router_logits=True,
                                     router_aux_loss_coef=0.02, tie_word_embeddings=False)


CONFIGS: Dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
    "gpt_oss": _gpt_oss,
}
MOE = {"qwen3_moe", "mixtral", "gpt_oss"}


def build(arch: str, seed: int = 5) -> transformers.PreTrainedModel:
    """transformers' own class for the architecture, randomly initialised by transformers (fp32)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]())
    # Biases that transformers initialises to zero get values, so that a slip in them shows.
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.float().eval()


def rows(n: int, seed: int) -> List[Dict[str, List[int]]]:
    """n rows of SEQ tokens; labels -100 on a prompt of 0 to SEQ/2 tokens, so that micro-batches count
    unequal numbers of targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g).tolist()
        prompt = int(torch.randint(0, SEQ // 2 + 1, (1,), generator=g))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def batches(data, steps: int, micro: int, accum: int) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """The rows in order, as Trainer's sequential sampler gives them: step s, micro-batch j takes rows
    (s * accum + j) * micro onwards."""
    out = []
    for s in range(steps):
        step = []
        for j in range(accum):
            chunk = data[(s * accum + j) * micro:(s * accum + j + 1) * micro]
            step.append((torch.tensor([r["input_ids"] for r in chunk]), torch.tensor([r["labels"] for r in chunk])))
        out.append(step)
    return out


class Slip:
    """A deliberate semantic slip put into the reference, to show the comparison catches it."""

    NONE = ""
    ROPE_HALF = "rope_half"          # RoPE's halves rotated the other way (x2, -x1) instead of (-x2, x1)
    ROUTER_BIAS = "router_bias"      # gpt-oss's router without its bias
    MICRO_MEAN = "micro_mean"        # the loss a mean of micro-batch means, not over the window's targets


def train(model: transformers.PreTrainedModel, steps_data, *, lr: float, warmup: int, weight_decay: float,
          max_grad_norm: float, betas=(0.9, 0.95), eps: float = 1e-8, slip: str = Slip.NONE):
    """Trains `model` in place as Hugging Face's Trainer does with these arguments (transformers 5):
    AdamW (torch.optim.AdamW) with weight decay on the parameters Trainer.get_decay_parameter_names
    names, the linear schedule with warmup, clip_grad_norm_, gradients set to None between steps (an
    expert no token chose has none, and AdamW skips it), and each micro-batch's loss as the model
    computes it with num_items_in_batch: the summed cross-entropy of its counted targets over those of
    the whole accumulation window, plus router_aux_loss_coef times its load-balancing loss when
    output_router_logits is set, never divided by the accumulation steps (Trainer.training_step
    leaves a loss normalised by num_items_in_batch as it is).

    Returns per step the mean cross-entropy over the window's targets (float64 sums), the mean
    load-balancing loss of its micro-batches (NaN for dense models), and the gradient norm."""
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    sched = transformers.get_linear_schedule_with_warmup(opt, warmup, len(steps_data))
    moe = bool(getattr(model.config, "output_router_logits", False))
    restore = []
    if slip == Slip.ROPE_HALF:
        restore = _slip_rope(model)
    if slip == Slip.ROUTER_BIAS:
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and getattr(m, "bias", None) is not None]
        if not routers:
            raise AssertionError(f"{type(model).__name__} has no biased router to slip")
        for mod in routers:
            def forward_without_bias(hidden_states, m=mod):
                logits = torch.nn.functional.linear(hidden_states, m.weight)
                top, idx = torch.topk(logits, m.top_k, dim=-1)
                return logits, torch.nn.functional.softmax(top, dim=1, dtype=top.dtype), idx
            mod.forward = forward_without_bias
            restore.append(lambda m=mod: m.__dict__.pop("forward", None))
    losses, aux_losses, norms = [], [], []
    model.train()
    for step in steps_data:
        # A micro-batch is (ids, labels), or a list of them: the documents of packed rows, each run
        # alone (what packing without cross-document attention must equal).
        pieces = [p for mb in step for p in (mb if isinstance(mb, list) else [mb])]
        items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in pieces)
        ce_sum, aux = 0.0, []
        for ids, labels in pieces:
            kw = {"output_router_logits": True} if moe else {}
            out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(items), **kw)
            loss = out.loss
            if slip == Slip.MICRO_MEAN:
                counted = int((labels[:, 1:] != -100).sum())
                loss = loss * items / max(counted, 1) / len(pieces)
            loss.backward()
            logits = out.logits.double()
            ce_sum += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                              labels[:, 1:].reshape(-1), ignore_index=-100,
                                                              reduction="sum"))
            if moe:
                aux.append(float(out.aux_loss))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        sched.step()
        model.zero_grad(set_to_none=True)
        losses.append(ce_sum / items)
        aux_losses.append(sum(aux) / len(aux) if aux else math.nan)
    for undo in restore:
        undo()
    model.eval()
    return losses, aux_losses, norms


def _slip_rope(model) -> list:
    """Replaces rotate_half in the model's modeling module by the other rotation."""
    module = __import__(type(model).__module__, fromlist=["rotate_half"])
    undo = []
    if hasattr(module, "rotate_half"):
        original = module.rotate_half

        def wrong(x):
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
            return torch.cat((x2, -x1), dim=-1)

        module.rotate_half = wrong
        undo.append(lambda: setattr(module, "rotate_half", original))
    if hasattr(module, "_apply_rotary_emb"):  # gpt-oss rotates its halves in its own function
        original_apply = module._apply_rotary_emb

        def wrong_apply(x, cos, sin):
            first, second = torch.chunk(x, 2, dim=-1)
            return torch.cat((first * cos + second * sin, second * cos - first * sin), dim=-1)

        module._apply_rotary_emb = wrong_apply
        undo.append(lambda: setattr(module, "_apply_rotary_emb", original_apply))
    if not undo:
        raise AssertionError(f"{type(model).__module__} has no rotate_half to slip")
    return undo


def double_copy(model):
    return copy.deepcopy(model).double()
