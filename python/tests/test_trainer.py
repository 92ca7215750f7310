"""mt.Trainer against megatrain-exec, the callbacks' order, stopping and resuming, and the errors."""

import json
import os
import re

import numpy as np
import pytest

import megatrain as mt
from conftest import MODEL, assert_same_tensors, exe, manifest, rows, run_exec


def args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=1e-3, weight_decay=0.1, warmup_steps=1, logging_steps=1, save_steps=500, seed=7,
                max_seq_length=32, data_order="shuffled")
    base.update(kw)
    return mt.TrainingArguments(**base)


def test_python_and_megatrain_exec_train_the_same_bits(tmp_path):
    data = rows(10, seed=1)
    trainer = mt.Trainer(model=MODEL, args=args(tmp_path / "py"), train_dataset=data)
    out = trainer.train()
    assert out.global_step == 4 and trainer.state.global_step == 4
    py_ckpt = os.path.join(trainer.checkpoint_dir, "step-00000004")
    # The same plan and rows through the command line.
    cli_ckpt = tmp_path / "cli"
    run_exec(str(tmp_path / "py" / "megatrain.plan.json"), "--data", str(tmp_path / "py" / "data" / "train.mtseq"),
             "--checkpoint-dir", str(cli_ckpt), "--steps", "4")
    assert_same_tensors(os.path.join(py_ckpt, "model.safetensors"), str(cli_ckpt / "step-00000004" / "model.safetensors"))
    assert_same_tensors(os.path.join(py_ckpt, "optimizer.safetensors"), str(cli_ckpt / "step-00000004" / "optimizer.safetensors"))
    py_losses = manifest(py_ckpt)["losses"]["values"]
    assert py_losses == manifest(str(cli_ckpt / "step-00000004"))["losses"]["values"]
    # log_history: one entry per step (logging_steps=1), with the step's loss, then the run's metrics.
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == [1, 2, 3, 4]
    assert [e["loss"] for e in logged] == py_losses
    assert all(e["tokens_per_second"] > 0 and e["grad_norm"] > 0 for e in logged)
    # One unit for speed: tokens/s over every position (the plan's unit), targets/s over the counted
    # ones (the rows' prompts and padding are masked, so fewer), in the log and the progress line.
    assert all(e["targets_per_second"] < e["tokens_per_second"] for e in logged)
    lines = [ln for ln in run_exec(str(tmp_path / "py" / "megatrain.plan.json"), "--data", str(tmp_path / "py" / "data" / "train.mtseq"),
                                   "--steps", "4").stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 4 and all(re.search(r"\d+ tokens/s \(\d+ targets/s\)", ln) for ln in lines), lines
    # Hugging Face's linear schedule with 1 warmup step of 4: 0, then 1e-3 x (4 - s) / 3.
    assert [e["learning_rate"] for e in logged] == pytest.approx([0.0, 1e-3, 1e-3 * 2 / 3, 1e-3 / 3], rel=1e-12, abs=1e-18)
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(np.mean(py_losses))
    assert out.training_loss == pytest.approx(np.mean(py_losses))
    # save_model: the newest checkpoint's weights and config, loadable as a Hugging Face folder.
    saved = trainer.save_model(str(tmp_path / "final"))
    assert_same_tensors(os.path.join(saved, "model.safetensors"), os.path.join(py_ckpt, "model.safetensors"))
    assert json.load(open(os.path.join(saved, "config.json")))["hidden_size"] == 64
    assert mt.Model.from_pretrained(saved).weights == saved


def test_a_model_folder_starts_from_its_weights_as_megatrain_exec_init_does(tmp_path):
    # A first run's saved folder is a Hugging Face model folder: train on from it through Python and
    # through megatrain-exec --init, and compare.
    first = mt.Trainer(model=MODEL, args=args(tmp_path / "first", max_steps=2), train_dataset=rows(8, seed=13))
    first.train()
    folder = first.save_model(str(tmp_path / "folder"))
    model = mt.Model.from_pretrained(folder)
    # 119,104 by hand: embedding and head 2 x 256 x 64, per layer q, o 64x64, k, v 64x32, MLP 3 x 64 x 160,
    # two norms of 64 (x 2 layers), the final norm 64.
    assert model.weights == folder and model.config["num_key_value_heads"] == 2 and model.num_parameters == 119104
    data = rows(8, seed=14)
    second = mt.Trainer(model=model, args=args(tmp_path / "second", max_steps=3), train_dataset=data)
    second.train()
    run_exec(str(tmp_path / "second" / "megatrain.plan.json"), "--data", str(tmp_path / "second" / "data" / "train.mtseq"),
             "--init", folder, "--checkpoint-dir", str(tmp_path / "cli"), "--steps", "3")
    assert_same_tensors(os.path.join(second.checkpoint_dir, "step-00000003", "model.safetensors"),
                        str(tmp_path / "cli" / "step-00000003" / "model.safetensors"))


class Recorder:
    def __init__(self, stop_at=None):
        self.events = []
        self.stop_at = stop_at

    def _add(self, name, state, **kw):
        self.events.append((name, state.global_step))

    def on_train_begin(self, args, state, control, **kw):
        self._add("train_begin", state)

    def on_step_begin(self, args, state, control, **kw):
        self._add("step_begin", state)

    def on_step_end(self, args, state, control, **kw):
        self._add("step_end", state)
        if self.stop_at is not None and state.global_step == self.stop_at:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kw):
        assert "loss" in logs or "eval_loss" in logs
        self._add("log", state)

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        assert metrics["eval_loss"] > 0
        self._add("evaluate", state)

    def on_save(self, args, state, control, **kw):
        self._add("save", state)

    def on_train_end(self, args, state, control, **kw):
        self._add("train_end", state)


def test_callbacks_come_in_hugging_face_order(tmp_path):
    # 6 steps with accumulation 2, logging every 2, saving and evaluating every 3: Hugging Face's
    # order is step_end, then log, evaluate (which logs its metrics first), save.
    rec = Recorder()
    trainer = mt.Trainer(model=MODEL, args=args(tmp_path, max_steps=6, logging_steps=2, save_steps=3, eval_steps=3),
                         train_dataset=rows(12, seed=2), eval_dataset=rows(5, seed=12), callbacks=[rec])
    trainer.train()
    expected = [("train_begin", 0)]
    for s in range(1, 7):
        expected += [("step_begin", s - 1), ("step_end", s)]
        if s % 2 == 0:
            expected.append(("log", s))
        if s % 3 == 0:
            expected += [("log", s), ("evaluate", s), ("save", s)]
    expected.append(("train_end", 6))
    assert rec.events == expected
    assert {d for d in os.listdir(trainer.checkpoint_dir) if d.startswith("step-")} == {"step-00000003", "step-00000006"}
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evals] == [3, 6] and all(e["eval_tokens"] > 0 for e in evals)
    # evaluate() after training: the newest checkpoint's weights, the same loss as the last pass.
    again = trainer.evaluate()
    assert again["eval_loss"] == evals[-1]["eval_loss"]


def test_a_callback_stops_training_and_resuming_matches_an_uninterrupted_run(tmp_path):
    data = rows(12, seed=3)
    whole = mt.Trainer(model=MODEL, args=args(tmp_path / "whole", max_steps=6), train_dataset=data)
    whole.train()
    rec = Recorder(stop_at=4)
    part = mt.Trainer(model=MODEL, args=args(tmp_path / "part", max_steps=6), train_dataset=data, callbacks=[rec])
    out = part.train()
    assert out.global_step == 4
    assert ("save", 4) in rec.events and ("step_begin", 4) not in rec.events
    again = mt.Trainer(model=MODEL, args=args(tmp_path / "part", max_steps=6), train_dataset=data)
    out = again.train(resume_from_checkpoint=True)
    assert out.global_step == 6
    assert_same_tensors(os.path.join(whole.checkpoint_dir, "step-00000006", "model.safetensors"),
                        os.path.join(again.checkpoint_dir, "step-00000006", "model.safetensors"))
    # The resumed run's log_history starts with the first run's steps (trainer_state.json), as the
    # uninterrupted run's does.
    steps_logged = [(e["step"], e["loss"]) for e in again.state.log_history if "loss" in e]
    assert steps_logged == [(e["step"], e["loss"]) for e in whole.state.log_history if "loss" in e]


def test_save_total_limit_keeps_the_newest_checkpoints_and_the_run_resumes_from_them(tmp_path):
    data = rows(12, seed=3)
    whole = mt.Trainer(model=MODEL, args=args(tmp_path / "whole", max_steps=6), train_dataset=data)
    whole.train()
    # A checkpoint after every step, the newest 2 kept; stopped after step 4 by a callback.
    first = mt.Trainer(model=MODEL, args=args(tmp_path / "kept", max_steps=6, save_steps=1, save_total_limit=2), train_dataset=data,
                       callbacks=[Recorder(stop_at=4)])
    assert first.train().global_step == 4

    def steps(t):
        return sorted(d for d in os.listdir(t.checkpoint_dir) if d.startswith("step-"))

    assert steps(first) == ["step-00000003", "step-00000004"]
    assert not [d for d in os.listdir(first.checkpoint_dir) if d.startswith(".step-")]
    again = mt.Trainer(model=MODEL, args=args(tmp_path / "kept", max_steps=6, save_steps=1, save_total_limit=1), train_dataset=data)
    assert again.train(resume_from_checkpoint=True).global_step == 6
    assert steps(again) == ["step-00000006"]
    assert_same_tensors(os.path.join(whole.checkpoint_dir, "step-00000006", "model.safetensors"),
                        os.path.join(again.checkpoint_dir, "step-00000006", "model.safetensors"))


def test_a_callback_exception_stops_training_and_propagates(tmp_path):
    class Boom:
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                raise RuntimeError("boom at step 2")

    trainer = mt.Trainer(model=MODEL, args=args(tmp_path), train_dataset=rows(10, seed=4), callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom at step 2"):
        trainer.train()
    assert trainer.state.global_step == 2


def test_plan_reports_the_planners_choice(tmp_path):
    trainer = mt.Trainer(model=MODEL, args=args(tmp_path), train_dataset=rows(10, seed=5))
    p = trainer.plan()
    assert p["feasible"] is True
    plan = p["plan"]
    assert plan["training"]["micro_batch"] == 2 and plan["training"]["grad_accum"] == 2 and plan["training"]["seq_len"] == 32
    assert plan["training"]["lr"] == 1e-3 and plan["optimizer"]["beta2"] == 0.999 and plan["optimizer"]["weight_decay"] == 0.1
    assert plan["predicted"]["tokens_per_s"] > 0
    for key in ("bottleneck", "alternatives", "search"):
        assert key in p
    sim = mt.simulate(plan)
    assert sim["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"], rel=1e-9)


def test_inspect_and_size_give_the_command_lines_keys():
    info = mt.inspect(MODEL, seq=64)
    assert info["parameters"] == mt.Model.from_pretrained(MODEL).num_parameters
    assert "flops_per_token" in info
    llama = mt.inspect("llama-2-7b")
    assert 6.7e9 < llama["parameters"] < 6.8e9  # published: 6.74B


# ---- errors -------------------------------------------------------------------------------------

def test_a_missing_model_folder_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        mt.Model.from_pretrained(str(tmp_path / "no-such-model"))


@pytest.mark.parametrize("field,value,accepted", [
    ("per_device_train_batch_size", 0, "an integer from 1 to 1048576"),
    ("per_device_train_batch_size", 2**40, "an integer from 1 to 1048576"),
    ("max_steps", 2**63, "up to 1000000000"),
    ("save_total_limit", 2**64, "an integer from 0 to 1000000000, or None"),
    ("learning_rate", -1.0, "a number in"),
    ("lr_scheduler_type", "polynomial", "'linear'"),
    ("data_order", "random", "'shuffled'"),
    ("max_steps", 0, "a positive integer"),
    ("save_total_limit", -1, "an integer from 0 to 1000000000, or None"),
])
def test_a_bad_argument_is_a_value_error_naming_it(tmp_path, field, value, accepted):
    with pytest.raises(ValueError) as e:
        args(tmp_path, **{field: value})
    assert field in str(e.value) and accepted in str(e.value)


@pytest.mark.parametrize("field,value", [
    ("per_device_train_batch_size", "2"), ("max_steps", 2.5), ("save_total_limit", "3"), ("learning_rate", "1e-3"),
    ("bf16", "yes"), ("lr_scheduler_type", ["linear"]), ("output_dir", 42),
])
def test_a_wrong_type_is_a_type_error_naming_it(tmp_path, field, value):
    with pytest.raises(TypeError) as e:
        args(tmp_path, **{field: value})
    assert field in str(e.value), str(e.value)


def test_a_model_too_big_for_max_ram_gb_is_a_plan_error(tmp_path):
    mt.init(rig="cpu-dev-2core", max_ram_gb=0.001)
    trainer = mt.Trainer(model="small-llama", args=args(tmp_path), train_dataset=rows(10, seed=6))
    with pytest.raises(mt.PlanError) as e:
        trainer.plan()
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert "ram needs" in msg and "short by" in msg and "bytes)" in msg, msg


def test_a_corrupt_checkpoint_is_a_checkpoint_error(tmp_path):
    data = rows(10, seed=8)
    trainer = mt.Trainer(model=MODEL, args=args(tmp_path, max_steps=2), train_dataset=data)
    trainer.train()
    weights = os.path.join(trainer.checkpoint_dir, "step-00000002", "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    again = mt.Trainer(model=MODEL, args=args(tmp_path, max_steps=4), train_dataset=data)
    with pytest.raises(mt.CheckpointError, match="model.safetensors"):
        again.train(resume_from_checkpoint=True)


def test_a_row_whose_labels_are_not_its_ids_is_refused(tmp_path):
    bad = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 9, 4]}] * 4
    trainer = mt.Trainer(model=MODEL, args=args(tmp_path), train_dataset=bad)
    with pytest.raises(ValueError, match=r"row 0: labels\[2\] is 9"):
        trainer.train()


def test_hugging_face_arguments_are_read_and_unknown_settings_refused(tmp_path):
    class HfArgs:  # what transformers.TrainingArguments.to_dict() gives, in part
        def __init__(self, **kw):
            self.values = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                               learning_rate=2e-5, logging_steps=5.0, report_to=["tensorboard"], fp16=False,
                               optim="adamw_torch", lr_scheduler_kwargs={}, save_strategy="steps", disable_tqdm=True)
            self.values.update(kw)

        def to_dict(self):
            return dict(self.values)

    a = mt.TrainingArguments.from_hf(HfArgs())
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps, a.learning_rate, a.logging_steps) == (2, 4, 2e-5, 5)
    assert mt.TrainingArguments.from_hf(HfArgs(save_total_limit=3)).save_total_limit == 3
    with pytest.raises(ValueError, match="fp16"):
        mt.Trainer(model=MODEL, args=HfArgs(fp16=True), train_dataset=rows(4, seed=9))
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        mt.TrainingArguments.from_hf(HfArgs(label_smoothing_factor=0.1))
    with pytest.raises(ValueError, match="some_future_field"):
        mt.TrainingArguments.from_hf(HfArgs(some_future_field=3))


def test_offload_dir_holds_the_nvme_tier_when_ram_is_capped(tmp_path):
    # small-llama's training state (4.6M parameters: 74 MB in fp32 with Adam) in 0.07 GiB of RAM: the
    # planner puts the optimizer states on the NVMe tier, in offload_dir, and the run matches one
    # with everything in RAM (same plan knobs otherwise: the NVMe tier is exact).
    data = rows(8, seed=15, vocab=256)
    mt.init(rig="cpu-dev-2core", max_ram_gb=0.07, offload_dir=str(tmp_path / "offload"))
    capped = mt.Trainer(model="small-llama", args=args(tmp_path / "capped", max_steps=3), train_dataset=data)
    placement = capped.plan()["plan"]["placement"]
    assert placement["optimizer_states"] == "nvme" and placement["nvme_dirs"] == [str(tmp_path / "offload")]
    capped.train()
    mt.init(rig="cpu-dev-2core")
    free = mt.Trainer(model="small-llama", args=args(tmp_path / "free", max_steps=3), train_dataset=data)
    assert free.plan()["plan"]["placement"]["optimizer_states"] == "ram"
    free.train()
    a = [e["loss"] for e in capped.state.log_history if "loss" in e]
    b = [e["loss"] for e in free.state.log_history if "loss" in e]
    assert a == pytest.approx(b, rel=1e-6)


def test_size_gives_what_megatrain_plan_size_json_gives():
    r = mt.size("llama-2-7b", gpu="H100")
    import subprocess
    cli = json.loads(subprocess.run([exe("megatrain-plan"), "size", "--model", "llama-2-7b", "--gpu", "H100", "--json"],
                                    capture_output=True, text=True, check=True).stdout)
    assert sorted(r) == sorted(cli)
    assert [(x["gpu"], x["trains"], x["ram_bytes"], x["drives"]) for x in r["rigs"]] == \
        [(x["gpu"], x["trains"], x["ram_bytes"], x["drives"]) for x in cli["rigs"]]


def test_without_a_rig_this_machine_is_profiled_once_and_cached(tmp_path):
    mt.init(offload_dir=str(tmp_path / "cache"))
    os.environ.pop("MEGATRAIN_RIG", None)
    first = mt.Trainer(model=MODEL, args=args(tmp_path / "a"), train_dataset=rows(8, seed=16))
    assert first.plan()["feasible"]
    profiles = list((tmp_path / "cache").glob("megatrain-rig-profile-*.json"))
    assert len(profiles) == 1, profiles  # one per model and sequence length
    cached = profiles[0]
    rig = json.load(open(cached))
    assert rig["host"]["cores"] >= 1 and rig["storage"][0]["path"] == str(tmp_path / "cache")
    # made for the model at the run's sequence length: its layer and head probed, its GEMM shapes on the grid
    assert rig["gpu"]["layer_times"]["seq"] == 32
    assert rig["gpu"]["layer_times"]["vocab"] > 0 and "gemm_shapes" in rig["gpu"]
    stamp = cached.stat().st_mtime_ns
    second = mt.Trainer(model=MODEL, args=args(tmp_path / "b"), train_dataset=rows(8, seed=16))
    assert second.plan()["feasible"]
    assert cached.stat().st_mtime_ns == stamp  # not measured again
