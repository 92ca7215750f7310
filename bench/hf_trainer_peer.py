"""Hugging Face's Trainer against mt.Trainer on the CPU (issue 46): the same transformers model
(small-llama, 4.6M parameters, built by transformers' LlamaForCausalLM from
profiles/models/small-llama.json), the same rows (byte tokens of the Debian licence texts, 128 per
row), the same transformers.TrainingArguments (micro-batch 4, accumulation 4, AdamW, weight decay
0.1, clipping 1.0, linear schedule, sequential order), two threads each, interleaved in rounds.
Prints tokens per second over the steps after the first (every position of every row counts, the
loss counts 127 of 128), timed by each trainer's on_step_end callback, and the ratio (>1: MegaTrain
is faster).

Usage: PYTHONPATH=build/python build/venv/bin/python bench/hf_trainer_peer.py [STEPS] [ROUNDS]
"""

import copy
import glob
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402
import transformers  # noqa: E402

import megatrain as mt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
B, A, T = 4, 4, 128
torch.set_num_threads(2)


class Clock(transformers.TrainerCallback):
    """Times each optimizer step (both trainers call on_step_end after the update)."""

    def __init__(self):
        self.marks = []

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.marks:
            self.marks.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(time.perf_counter())

    def tokens_per_s(self):
        spans = [b - a for a, b in zip(self.marks, self.marks[1:])][1:]  # after the first step
        return B * A * T * len(spans) / sum(spans)


def model():
    config = json.load(open(os.path.join(HERE, "..", "profiles", "models", "small-llama.json")))
    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items()
                                      if k not in ("architectures", "model_type", "transformers_version", "torch_dtype")})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def rows():
    text = b"".join(open(f, "rb").read() for f in sorted(glob.glob("/usr/share/common-licenses/*")))
    n = STEPS * A * B
    return [{"input_ids": list(text[i * T:(i + 1) * T]), "labels": list(text[i * T:(i + 1) * T])} for i in range(n)]


def args(out):
    return transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=B, gradient_accumulation_steps=A,
                                          max_steps=STEPS, learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0,
                                          adam_beta2=0.95, logging_steps=STEPS, save_strategy="no", report_to="none",
                                          train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True,
                                          dataloader_num_workers=0)


class Rows(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {k: torch.tensor(v) for k, v in self.data[i].items()}


def hf_run(base, data, out):
    clock = Clock()
    trainer = transformers.Trainer(model=copy.deepcopy(base), args=args(out), train_dataset=Rows(data), callbacks=[clock])
    trainer.train()
    return clock.tokens_per_s()


def mt_run(base, data, out):
    clock = Clock()
    mt.init(rig="cpu-dev-2core")
    trainer = mt.Trainer(model=copy.deepcopy(base), args=args(out), train_dataset=data, callbacks=[clock])
    trainer.train()
    return clock.tokens_per_s()


def main():
    base, data = model(), rows()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, megatrain {mt.__version__}; "
          f"{sum(p.numel() for p in base.parameters()):,} parameters, {STEPS} steps of {B} x {A} rows of {T} tokens, 2 threads")
    print("round  HF Trainer tok/s  mt.Trainer tok/s  ratio")
    for r in range(ROUNDS):
        with tempfile.TemporaryDirectory() as tmp:
            hf = hf_run(base, data, os.path.join(tmp, "hf"))
            ours = mt_run(base, data, os.path.join(tmp, "mt"))
        print(f"{r + 1:5d}  {hf:16.0f}  {ours:16.0f}  {ours / hf:5.2f}x")


if __name__ == "__main__":
    main()
