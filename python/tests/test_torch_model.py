"""A PyTorch model object trained through mt.Trainer, against an independent PyTorch training of the
same rows (loss masks with -100 included).

Tolerance (docs/testing.md, "fp32 check"): each side's fp32 error is measured against a float64 run
of the same math. PyTorch's float64 run stands in for ours (our float64 layer templates agree with it
to 5e-16 in loss and 3e-13 in weights, TorchReference.*), so our fp32 error must be within 8 times
PyTorch's fp32 error, per step's loss (floored at 1e-7) and over all weights together.
"""

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import megatrain as mt  # noqa: E402
from conftest import rows, tensors  # noqa: E402
from tiny_torch_llama import TinyLlama, train_reference  # noqa: E402

FACTOR = 8.0
FLOOR = 1e-7
B, A, L, STEPS = 2, 2, 32, 4


def reference_batches(data, dtype_ids=torch.long):
    n = len(data)
    out = []
    for s in range(STEPS):
        step = []
        for j in range(A):
            ids = torch.zeros((B, L), dtype=dtype_ids)
            labels = torch.full((B, L), -100, dtype=dtype_ids)
            for b in range(B):
                row = data[((s * A + j) * B + b) % n]
                m = min(len(row["input_ids"]), L)
                ids[b, :m] = torch.tensor(row["input_ids"][:m])
                labels[b, :m] = torch.tensor(row["labels"][:m])
            step.append((ids, labels))
        out.append(step)
    return out


def test_a_pytorch_model_trains_in_place_like_pytorch(tmp_path):
    torch.set_num_threads(1)
    data = rows(12, seed=21, lo=10, hi=40)  # some rows longer than L: truncated; shorter: padded
    model = TinyLlama(seed=3)
    ref32 = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
    args = mt.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=B, gradient_accumulation_steps=A,
                                max_steps=STEPS, learning_rate=hyper["lr"], adam_beta2=hyper["betas"][1], weight_decay=hyper["weight_decay"],
                                lr_scheduler_type="constant", max_grad_norm=hyper["max_grad_norm"], max_seq_length=L,
                                data_order="sequential", logging_steps=1)
    trainer = mt.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    ours = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(ours) == STEPS

    # The model's parameters were updated in place with the written weights, bit for bit.
    written = tensors(os.path.join(trainer.checkpoint_dir, f"step-{STEPS:08d}", "model.safetensors"))
    for name, p in model.state_dict().items():
        assert np.array_equal(p.numpy().view(np.uint32), written[name].view(np.uint32)), name

    batches = reference_batches(data)
    l32 = train_reference(ref32, batches, **hyper)
    l64 = train_reference(ref64, batches, **hyper)
    for s in range(STEPS):
        e_ours = abs(ours[s] - l64[s]) / abs(l64[s])
        e_torch = abs(l32[s] - l64[s]) / abs(l64[s])
        print(f"step {s + 1}: loss ours {ours[s]:.9f} torch32 {l32[s]:.9f} torch64 {l64[s]:.12f}: errors {e_ours:.2e} / {e_torch:.2e}")
        assert e_ours <= FACTOR * max(e_torch, FLOOR), f"step {s + 1}"

    def flat(m):
        return torch.cat([p.detach().double().reshape(-1) for p in m.state_dict().values()])

    w64 = flat(ref64)
    e_ours = float((flat(model) - w64).norm() / w64.norm())
    e_torch = float((flat(ref32) - w64).norm() / w64.norm())
    print(f"weights: errors against float64 ours {e_ours:.2e}, PyTorch fp32 {e_torch:.2e}")
    assert e_ours <= FACTOR * max(e_torch, FLOOR)
    # Evaluation: a forward-only pass over other rows (5: the last micro-batch is short) against a
    # PyTorch forward of the trained model over the same rows, HF's loss: the mean over counted targets.
    held_out = rows(5, seed=22, lo=10, hi=40)
    metrics = trainer.evaluate(held_out)
    with torch.no_grad():
        total, counted = 0.0, 0
        for row in held_out:
            ids = torch.tensor([row["input_ids"][:L]])
            labels = torch.tensor([row["labels"][:L]])
            logits = model(ids).double()
            total += float(torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum"))
            counted += int((labels[0, 1:] != -100).sum())
    print(f"eval: ours {metrics['eval_loss']:.9f}, PyTorch {total / counted:.9f} over {counted} targets")
    assert metrics["eval_tokens"] == counted
    assert metrics["eval_loss"] == pytest.approx(total / counted, rel=1e-5)
    # And the training moved the weights far more than the tolerance.
    assert float((flat(model) - flat(TinyLlama(seed=3))).norm() / w64.norm()) > 100 * FACTOR * max(e_torch, FLOOR)
