"""MegaTrain against transformers itself (issue 46), for every architecture it trains.

For each class (hf_models.CONFIGS) a small random model is built by transformers' own config and model
classes and written with save_pretrained (safetensors). Then:

- forward: MegaTrain's logits (mt.Model.logits, the CPU backend's layers) against transformers'
  forward on the same rows;
- training: 4 optimizer steps with gradient accumulation over micro-batches of unequal counted
  targets, clipping, weight decay and a linear warmup schedule, trained by megatrain-exec and by
  mt.Trainer given the transformers model and a transformers.TrainingArguments, against the
  transformers model trained as Hugging Face's Trainer does (hf_models.train): per-step losses, the
  MoE load-balancing loss, and the final weights;
- the way back: the folders that megatrain-exec and trainer.save_model() write load with
  AutoModelForCausalLM.from_pretrained with no missing or unexpected keys, and give MegaTrain's logits.

Tolerances (docs/testing.md, "transformers as the reference"): transformers in float64 is the truth.
Each fp32 result's error against it must be within FACTOR times transformers' own fp32 error on the
same quantity, measured in the same run (floored at FLOOR, near fp32's unit roundoff), so the bound
moves with the machine's BLAS and instruction set. Slips put into the reference on purpose must fail.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import megatrain as mt
from megatrain.data import rows_to_arrays

import hf_models as hf
from hf_models import Slip

# The package's own test helpers: the shipped 2-core rig for every run (an autouse fixture) and the
# build's programs (MEGATRAIN_BIN_DIR).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tests"))
from conftest import RIG, _rig, exe  # noqa: E402,F401

torch.set_num_threads(1)  # ctest runs two tests at once on two cores (docs/testing.md)

FACTOR = 8.0
FLOOR = 1e-7
B, A, STEPS = 2, 2, 4
HYPER = dict(lr=3e-3, warmup=2, weight_decay=0.1, max_grad_norm=1.0)


def rel(a, b):
    """|a - b| / |b| in the 2-norm, in float64."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def within(name, e_ours, e_hf):
    bound = FACTOR * max(e_hf, FLOOR)
    print(f"  {name}: ours {e_ours:.2e}, transformers fp32 {e_hf:.2e} (bound {bound:.2e})")
    return e_ours <= bound


def state64(model):
    return {n: t.detach().double().numpy() for n, t in model.state_dict().items()}


def saved(tmp_path, model, name="model"):
    folder = tmp_path / name
    model.save_pretrained(folder)  # safetensors
    return str(folder)


def load_back(folder):
    """AutoModelForCausalLM.from_pretrained of a folder MegaTrain wrote: no key may be missing or unexpected."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, experts_implementation="eager",
                                                                    attn_implementation="eager", dtype=torch.float32)
    assert not info["missing_keys"], f"{folder}: missing {info['missing_keys']}"
    assert not info["unexpected_keys"], f"{folder}: unexpected {info['unexpected_keys']}"
    assert not info.get("mismatched_keys"), f"{folder}: mismatched {info['mismatched_keys']}"
    return model.eval()


def logits_check(name, ours, model32, ids):
    """ours against transformers' fp32 forward, both measured against its float64 forward."""
    with torch.no_grad():
        t = torch.tensor(ids)
        hf32 = model32(t).logits.numpy()
        hf64 = copy.deepcopy(model32).double()(t).logits.numpy()
    return within(name, rel(ours, hf64), rel(hf32, hf64))


# ---- forward ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", list(hf.CONFIGS))
def test_forward_logits_equal_transformers(arch, tmp_path):
    model = hf.build(arch)
    folder = saved(tmp_path, model)
    ids = np.array([r["input_ids"] for r in hf.rows(3, seed=41)])
    ours = mt.Model.from_pretrained(folder).logits(ids)
    assert ours.shape == (3, hf.SEQ, hf.VOCAB)
    print(arch)
    assert logits_check("logits", ours, model, ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_packed_documents_attend_only_to_themselves(arch, tmp_path):
    """Rows packed with several documents and position_ids restarting at each (transformers'
    flattening collator, LLaMA-Factory's neat_packing): MegaTrain's logits of each document equal
    transformers' forward of that document alone (GQA, QK-norm, gpt-oss's sinks and sliding window)."""
    model = hf.build(arch)
    folder = saved(tmp_path, model)
    ids = np.array([r["input_ids"] for r in hf.rows(2, seed=17)])
    docs = [[5, 11, 8], [1, 13, 10]]  # lengths per row (a one-token document too)
    pos = np.array([[p for n in row for p in range(n)] for row in docs])
    ours = mt.Model.from_pretrained(folder).logits(ids, position_ids=pos)
    print(arch)
    ok = True
    for r, row in enumerate(docs):
        at = 0
        for n in row:
            alone = ids[r:r + 1, at:at + n]
            ok &= logits_check(f"row {r}, document at {at} of {n} tokens", ours[r:r + 1, at:at + n], model, alone)
            at += n
    assert ok
    # Without the position ids the same rows are one document each: different logits after the first.
    whole = mt.Model.from_pretrained(folder).logits(ids)
    assert np.abs(whole[0, 5:] - ours[0, 5:]).max() > 1e-3


def test_bf16_weights_are_read_as_transformers_reads_them(tmp_path):
    """A checkpoint saved in bf16 (as published models are): MegaTrain widens it to fp32 exactly as
    transformers does when it loads it in fp32."""
    model = hf.build("qwen2")
    folder = saved(tmp_path, model.to(torch.bfloat16))
    back = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ours = mt.Model.from_pretrained(folder).logits(np.array([r["input_ids"] for r in hf.rows(2, seed=3)]))
    assert logits_check("bf16 checkpoint logits", ours, back, np.array([r["input_ids"] for r in hf.rows(2, seed=3)]))


def test_mxfp4_experts_are_read_as_transformers_reads_them(tmp_path):
    """gpt-oss as published: experts in MXFP4 (blocks and scales), the rest in bf16, written by
    tests/python/mxfp4_checkpoint.py (its own writer and dequantiser). transformers loads it with
    Mxfp4Config(dequantize=True); its dequantised experts must equal the writer's values bit for bit,
    and MegaTrain's logits of the same folder must equal transformers'."""
    model = hf.build("gpt_oss")
    manifest = [{"name": n, "shape": list(t.shape),
                 "mxfp4": n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")}
                for n, t in model.state_dict().items()]
    assert sum(m["mxfp4"] for m in manifest) == 4
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    writer = os.path.join(os.path.dirname(__file__), "..", "python", "mxfp4_checkpoint.py")
    folder = tmp_path / "mxfp4"
    r = subprocess.run([sys.executable, writer, str(tmp_path / "manifest.json"), str(folder), "1",
                        str(tmp_path / "expected.safetensors"), "--trainable"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = dict(model.config.to_dict(), architectures=[type(model).__name__])
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager", experts_implementation="eager").eval()
    expected = mt._megatrain.read_safetensors(str(tmp_path / "expected.safetensors"))
    sd = theirs.state_dict()
    for m in manifest:
        if m["mxfp4"]:
            assert np.array_equal(sd[m["name"]].numpy().view(np.uint32), expected[m["name"]].view(np.uint32)), m["name"]
    ids = np.array([r["input_ids"] for r in hf.rows(2, seed=13)])
    ours = mt.Model.from_pretrained(str(folder)).logits(ids)
    assert logits_check("MXFP4 checkpoint logits", ours, theirs, ids)


# ---- training -----------------------------------------------------------------------------------

def write_plan(path, folder, steps=STEPS):
    plan = {"schema": "megatrain.plan/1", "model": folder, "rig": RIG,
            "training": {"seq_len": hf.SEQ, "micro_batch": B, "grad_accum": A, "steps": steps, "seed": 1,
                         "lr": HYPER["lr"], "lr_schedule": "linear-hf", "warmup_steps": HYPER["warmup"], "min_lr": 0.0,
                         "clip_grad_norm": HYPER["max_grad_norm"], "data_order": "sequential"},
            "precision": {"compute": "fp32", "master": "fp32", "transfer": "fp32"},
            "schedule": {"order": "layer-major", "prefetch_depth": 1, "device_layer_buffers": 2, "checkpoint_every": 1,
                         "checkpoint_location": "device"},
            "placement": {"master_weights": "ram", "optimizer_states": "ram", "nvme_dirs": [], "pinned_staging_bytes": 0,
                          "device_budget_bytes": 268435456},
            "optimizer": {"type": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": HYPER["weight_decay"],
                          "m_format": "fp32", "v_format": "fp32", "block_size": 128, "threads": 1}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(plan, f)


def write_data(path, data):
    tokens, mask, stats = rows_to_arrays(data, hf.SEQ, hf.VOCAB)
    mt._megatrain.write_sequences(str(path), tokens, mask, hf.VOCAB, -1, stats["pad_id"], len(tokens), 0,
                                  int(stats.get("tokens", tokens.size)), "answer", "rows")


def exec_run(tmp_path, folder, data):
    """megatrain-exec on the CPU backend: per-step losses and aux losses from its trace, and its last checkpoint."""
    write_plan(tmp_path / "plan.json", folder)
    write_data(tmp_path / "train.mtseq", data)
    p = subprocess.run([exe("megatrain-exec"), str(tmp_path / "plan.json"), "--data", str(tmp_path / "train.mtseq"),
                        "--init", folder, "--checkpoint-dir", str(tmp_path / "ck"), "--trace", str(tmp_path / "run.mtrace"),
                        "--backend", "cpu", "--threads", "1"], capture_output=True, text=True)
    assert p.returncode == 0, f"megatrain-exec exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    with sqlite3.connect(tmp_path / "run.mtrace") as db:
        cols = [r[1] for r in db.execute("PRAGMA table_info(steps)")]
        rows = db.execute(f"SELECT loss{', aux_loss' if 'aux_loss' in cols else ''} FROM steps ORDER BY step").fetchall()
    losses = [r[0] for r in rows]
    aux = [r[1] if len(r) > 1 and r[1] is not None else math.nan for r in rows]
    return losses, aux, str(tmp_path / "ck" / f"step-{STEPS:08d}")


def trainer_run(tmp_path, model, data):
    """mt.Trainer given the transformers model itself and a transformers.TrainingArguments."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=B,
                                          gradient_accumulation_steps=A, max_steps=STEPS, learning_rate=HYPER["lr"],
                                          warmup_steps=HYPER["warmup"], lr_scheduler_type="linear",
                                          weight_decay=HYPER["weight_decay"], max_grad_norm=HYPER["max_grad_norm"],
                                          adam_beta2=0.95, logging_steps=1, save_strategy="no",
                                          train_sampling_strategy="sequential", report_to="none")
    trainer = mt.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, losses


def compare_training(ours_losses, ours_aux, ours_state, ref, ok):
    """Per-step losses, the router loss where the reference trains one, the worst tensor and all weights."""
    l32, l64, a32, a64, w32, w64 = ref
    for s in range(STEPS):
        ok &= within(f"step {s + 1} loss", abs(ours_losses[s] - l64[s]) / abs(l64[s]), abs(l32[s] - l64[s]) / abs(l64[s]))
        if not math.isnan(a64[s]):
            ok &= within(f"step {s + 1} aux loss", abs(ours_aux[s] - a64[s]) / abs(a64[s]), abs(a32[s] - a64[s]) / abs(a64[s]))
    names = sorted(w64)
    assert sorted(ours_state) == names, f"tensors differ: {set(ours_state) ^ set(names)}"
    worst_ours = max(rel(ours_state[n], w64[n]) for n in names)
    worst_hf = max(rel(w32[n], w64[n]) for n in names)
    ok &= within("worst tensor", worst_ours, worst_hf)
    cat = lambda d: np.concatenate([np.asarray(d[n], dtype=np.float64).ravel() for n in names])  # noqa: E731
    ok &= within("all weights", rel(cat(ours_state), cat(w64)), rel(cat(w32), cat(w64)))
    return ok


def reference(arch, model, data, slip=Slip.NONE):
    steps = hf.batches(data, STEPS, B, A)
    m32, m64 = copy.deepcopy(model), hf.double_copy(model)
    l32, a32, _ = hf.train(m32, steps, **HYPER, slip=slip)
    l64, a64, _ = hf.train(m64, steps, **HYPER, slip=slip)
    return l32, l64, a32, a64, state64(m32), state64(m64)


@pytest.mark.parametrize("arch", list(hf.CONFIGS))
def test_training_equals_transformers(arch, tmp_path):
    model = hf.build(arch)
    folder = saved(tmp_path, model)
    data = hf.rows(STEPS * A * B, seed=7)
    ref = reference(arch, model, data)
    print(f"{arch}: reference losses {['%.6f' % x for x in ref[1]]}")

    # megatrain-exec
    losses, aux, ck = exec_run(tmp_path, folder, data)
    print("megatrain-exec:")
    # The checkpoint loads back into transformers (which reads it under its own names), and gives
    # MegaTrain's logits.
    back = load_back(ck)
    ok = compare_training(losses, aux, state64(back), ref, True)
    ids = np.array([r["input_ids"] for r in hf.rows(2, seed=9)])
    ok &= logits_check("checkpoint reloaded: logits", mt.Model.from_pretrained(folder).logits(ids, checkpoint=ck), back, ids)

    # mt.Trainer with the transformers model and arguments: the model holds the trained weights after.
    live = copy.deepcopy(model)
    trainer, t_losses = trainer_run(tmp_path, live, data)
    print("mt.Trainer:")
    ok = compare_training(t_losses, aux, state64(live), ref, ok)
    saved_to = trainer.save_model(str(tmp_path / "saved"))
    back = load_back(saved_to)
    with torch.no_grad():
        assert torch.equal(back(torch.tensor(ids)).logits, live(torch.tensor(ids)).logits), "save_model's folder differs from the model"
    ok &= logits_check("save_model reloaded: logits", mt.Model.from_pretrained(saved_to).logits(ids), back, ids)
    assert ok, f"{arch}: MegaTrain's training differs from transformers' (figures above)"


class _Rows(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {k: torch.tensor(v) for k, v in self.data[i].items()}


@pytest.mark.parametrize("arch", ["qwen2", "mixtral"])
def test_the_reference_loop_is_what_hugging_faces_trainer_does(arch, tmp_path):
    """hf_models.train is the reference above; here it is checked against transformers.Trainer
    itself with the same TrainingArguments (sequential order, on the CPU), both in float64 so that
    rounding cannot hide a difference: the same per-step gradient norms and final weights. Qwen2 has
    a tied head and biases; Mixtral the router loss over accumulation."""
    model = hf.double_copy(hf.build(arch))
    data = hf.rows(STEPS * A * B, seed=7)
    mine = copy.deepcopy(model)
    _, _, norms = hf.train(mine, hf.batches(data, STEPS, B, A), **HYPER)

    theirs = copy.deepcopy(model)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=B, gradient_accumulation_steps=A,
                                          max_steps=STEPS, learning_rate=HYPER["lr"], warmup_steps=HYPER["warmup"],
                                          lr_scheduler_type="linear", weight_decay=HYPER["weight_decay"],
                                          max_grad_norm=HYPER["max_grad_norm"], adam_beta2=0.95, save_strategy="no",
                                          report_to="none", train_sampling_strategy="sequential", use_cpu=True,
                                          disable_tqdm=True, logging_steps=1)
    trainer = transformers.Trainer(model=theirs, args=args, train_dataset=_Rows(data))
    trainer.train()
    seen = [float(e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]  # before clipping
    assert len(seen) == STEPS
    print(arch, "gradient norms: reference loop", [f"{x:.6f}" for x in norms], "Trainer", [f"{x:.6f}" for x in seen])
    for a, b in zip(norms, seen):
        assert abs(a - b) <= 1e-12 * b
    w_mine, w_theirs = state64(mine), state64(theirs)
    worst = max(rel(w_mine[n], w_theirs[n]) for n in w_mine)
    print(f"  final weights: worst tensor {worst:.1e}")
    assert worst < 1e-10


def neat_rows(n_rows, seed):
    """Rows of SEQ + 1 tokens packing 2 to 4 documents each (the last one cut at the row's end), the
    documents' first tokens marked as starts and never targets, prompts of some documents not counted;
    and for each row its documents as (ids, labels) pieces, each as transformers would see it alone."""
    g = torch.Generator().manual_seed(seed)
    tokens = np.zeros((n_rows, hf.SEQ + 1), dtype=np.uint32)
    mask = np.zeros((n_rows, hf.SEQ + 1), dtype=np.uint8)
    pieces = []
    for r in range(n_rows):
        row, at = [], 0
        while at < hf.SEQ:  # the row's inputs are tokens 0..SEQ-1; token SEQ is only a target
            n = min(int(torch.randint(1, 12, (1,), generator=g)), hf.SEQ - at)
            ids = torch.randint(3, hf.VOCAB, (n,), generator=g).tolist()
            prompt = int(torch.randint(0, n, (1,), generator=g)) if n > 1 else 0
            tokens[r, at:at + n] = ids
            mask[r, at] = 2  # a document starts (kMaskDocStart), and is no one's target
            mask[r, at + max(1, prompt):at + n] = 1
            row.append((torch.tensor([ids]), torch.tensor([[-100] * max(1, prompt) + ids[max(1, prompt):]])))
            at += n
        tokens[r, hf.SEQ] = 1  # the row's last target, not counted (the next document's start)
        mask[r, hf.SEQ] = 2
        pieces.append(row)
    return tokens, mask, pieces


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_oss"])
def test_packed_documents_train_as_transformers_on_each_document_alone(arch, tmp_path):
    """Packing without cross-document attention, trained by megatrain-exec on the CPU backend from a
    file packed "neat", against transformers trained on every document alone (the loss over the
    window's counted targets; gpt-oss's router loss is per forward, so per document there; it is
    left out of gpt-oss's objective here, output_router_logits false)."""
    model = hf.build(arch)
    if arch == "gpt_oss":
        model.config.output_router_logits = False
    folder = saved(tmp_path, model)
    tokens, mask, pieces = neat_rows(STEPS * A * B, seed=23)
    mt._megatrain.write_sequences(str(tmp_path / "train.mtseq"), tokens, mask, hf.VOCAB, -1, 0, int((mask & 2).sum()), 0,
                                  int(tokens.size), "answer", "rows", "neat")
    write_plan(tmp_path / "plan.json", folder)
    p = subprocess.run([exe("megatrain-exec"), str(tmp_path / "plan.json"), "--data", str(tmp_path / "train.mtseq"), "--init", folder,
                        "--checkpoint-dir", str(tmp_path / "ck"), "--trace", str(tmp_path / "run.mtrace"), "--backend", "cpu",
                        "--threads", "1"], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "neat" in p.stdout, p.stdout
    with sqlite3.connect(tmp_path / "run.mtrace") as db:
        losses = [r[0] for r in db.execute("SELECT loss FROM steps ORDER BY step")]
    steps = [[pieces[(s * A + j) * B + b] for j in range(A) for b in range(B)] for s in range(STEPS)]
    m32, m64 = copy.deepcopy(model), hf.double_copy(model)
    l32, a32, _ = hf.train(m32, steps, **HYPER)
    l64, a64, _ = hf.train(m64, steps, **HYPER)
    ref = (l32, l64, a32, a64, state64(m32), state64(m64))
    print(f"{arch} packed without cross-document attention, megatrain-exec:")
    ok = compare_training(losses, [], state64(load_back(str(tmp_path / "ck" / f"step-{STEPS:08d}"))), ref, True)
    # The same rows given to mt.Trainer as transformers' flattening collator makes them (position_ids).
    rows = [{"input_ids": [int(t) for p in row for t in p[0][0]], "labels": [int(t) for p in row for t in p[1][0]],
             "position_ids": [k for p in row for k in range(p[0].shape[1])]} for row in pieces]
    live = copy.deepcopy(model)
    _, t_losses = trainer_run(tmp_path, live, rows)
    print(f"{arch} packed without cross-document attention, mt.Trainer with position_ids:")
    ok = compare_training(t_losses, [], state64(live), ref, ok)
    assert ok


def test_position_ids_that_do_not_pack_documents_are_refused():
    ok = [{"input_ids": [5, 6, 7, 8], "position_ids": [0, 1, 0, 1]}]
    tokens, mask, stats = rows_to_arrays(ok, 4, hf.VOCAB)
    assert stats["packing"] == "neat" and mask[0].tolist() == [2, 1, 2, 1, 0]
    for bad, at in (([0, 1, 3, 4], 2), ([1, 2, 3, 4], 0)):
        with pytest.raises(ValueError, match=rf"row 0: position_ids\[{at}\]"):
            rows_to_arrays([{"input_ids": [5, 6, 7, 8], "position_ids": bad}], 4, hf.VOCAB)


# ---- slips: the comparison must fail on each ----------------------------------------------------

@pytest.mark.parametrize("arch,slip", [("llama", Slip.ROPE_HALF), ("gpt_oss", Slip.ROPE_HALF), ("gpt_oss", Slip.ROUTER_BIAS),
                                       ("qwen2", Slip.MICRO_MEAN), ("mixtral", Slip.MICRO_MEAN)])
def test_a_slip_in_the_reference_is_caught(arch, slip, tmp_path):
    model = hf.build(arch)
    folder = saved(tmp_path, model)
    data = hf.rows(STEPS * A * B, seed=7)
    losses, aux, ck = exec_run(tmp_path, folder, data)
    print(f"{arch} with the slip {slip}:")
    assert not compare_training(losses, aux, state64(load_back(ck)), reference(arch, model, data, slip=slip), True), \
        f"the slip {slip} was not caught"
