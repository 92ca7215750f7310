"""``mt.Trainer`` and ``mt.TrainingArguments``: Hugging Face's Trainer API over MegaTrain's run.

The Trainer plans (the planner's search for this model, batch shape and rig), writes the plan and
the data where the run reads them (``output_dir``), and calls the run megatrain-exec makes, in C++
with the GIL released. Python is entered at step boundaries only: callbacks, logging, evaluation.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _megatrain, config, errors
from .data import Dataset
from .errors import CheckpointError, PlanError
from .model import Model

__all__ = ["TrainingArguments", "Trainer", "TrainerState", "TrainerControl", "TrainOutput"]

TrainOutput = collections.namedtuple("TrainOutput", ["global_step", "training_loss", "metrics"])
TrainOutput.__doc__ = "What Trainer.train() returns: optimizer steps done, the mean loss of this call's steps, and the run's metrics."

# lr_scheduler_type -> the plan's lr_schedule: Hugging Face's own curves (core/plan.h, the -hf schedules).
# megatrain-exec's bound on steps (--steps, --keep-checkpoints) and a plan's on micro_batch,
# grad_accum and seq_len.
_MAX_STEPS = 1_000_000_000
_MAX_BATCH = 2**20
_SCHEDULERS = {"linear": "linear-hf", "cosine": "cosine-hf", "constant": "constant", "constant_with_warmup": "constant-hf"}
_DATA_ORDERS = ("shuffled", "sequential")


@dataclass
class TrainingArguments:
    """The training arguments, with Hugging Face's names, meanings and defaults where it has the
    field (``max_seq_length`` is TRL's; ``data_order`` is MegaTrain's)."""

    output_dir: str
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    num_train_epochs: float = 1
    max_steps: int = -1
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    logging_steps: int = 10
    save_steps: int = 500
    save_total_limit: Optional[int] = None
    eval_steps: Optional[int] = None
    seed: int = 42
    max_seq_length: Optional[int] = None
    bf16: bool = False
    data_order: str = "shuffled"

    def __post_init__(self):
        # Every argument is checked here, naming it: a wrong type is a TypeError, a value out of
        # range a ValueError, before anything reaches the extension (whose own conversion errors
        # name no argument). The bounds are megatrain-exec's and a plan's.
        if not isinstance(self.output_dir, (str, os.PathLike)):
            raise TypeError(f"output_dir={self.output_dir!r}: accepted: a folder path (str or os.PathLike)")
        self.output_dir = os.fspath(self.output_dir)
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ValueError("output_dir: empty; accepted: a folder for the plan, data, checkpoints and logs")

        def count(name, least, most, none_ok=False):
            v = getattr(self, name)
            if v is None and none_ok:
                return
            accepted = f"an integer from {least} to {most}" + (", or None" if none_ok else "")
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}={v!r}: accepted: {accepted}")
            if not least <= v <= most:
                raise ValueError(f"{name}={v!r}: accepted: {accepted} (an integer >= {least})")

        def number(name, low, high, low_open=False):
            v = getattr(self, name)
            accepted = f"a number in {'(' if low_open else '['}{low}, {high}]"
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name}={v!r}: accepted: {accepted}")
            if not (v == v and (v > low if low_open else v >= low) and v <= high):
                raise ValueError(f"{name}={v!r}: accepted: {accepted}")

        count("per_device_train_batch_size", 1, _MAX_BATCH)
        count("gradient_accumulation_steps", 1, _MAX_BATCH)
        count("warmup_steps", 0, _MAX_STEPS)
        count("logging_steps", 0, _MAX_STEPS)
        count("save_steps", 0, _MAX_STEPS)
        count("save_total_limit", 0, _MAX_STEPS, none_ok=True)
        count("eval_steps", 1, _MAX_STEPS, none_ok=True)
        count("seed", 0, 2**63 - 1)
        count("max_seq_length", 1, _MAX_BATCH, none_ok=True)
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int):
            raise TypeError(f"max_steps={self.max_steps!r}: accepted: a positive integer up to {_MAX_STEPS}, or -1")
        if (self.max_steps < 1 and self.max_steps != -1) or self.max_steps > _MAX_STEPS:
            raise ValueError(f"max_steps={self.max_steps!r}: accepted: a positive integer up to {_MAX_STEPS}, or -1 "
                             "(num_train_epochs decides)")
        number("learning_rate", 0, 1e3)
        number("weight_decay", 0, 1e3)
        number("adam_beta1", 0, 1)
        number("adam_beta2", 0, 1)
        number("adam_epsilon", 0, 1, low_open=True)
        number("max_grad_norm", 0, 1e30)
        number("num_train_epochs", 0, 1e9, low_open=True)
        if not isinstance(self.lr_scheduler_type, str) or not isinstance(self.data_order, str):
            raise TypeError(f"lr_scheduler_type={self.lr_scheduler_type!r}, data_order={self.data_order!r}: accepted: strings")
        if self.lr_scheduler_type not in _SCHEDULERS:
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r}: accepted: {', '.join(repr(k) for k in _SCHEDULERS)}")
        if self.lr_scheduler_type == "constant" and self.warmup_steps > 0:
            raise ValueError("lr_scheduler_type='constant' has no warmup (Hugging Face ignores warmup_steps with it); accepted: "
                             "lr_scheduler_type='constant_with_warmup', or warmup_steps=0")
        if self.data_order not in _DATA_ORDERS:
            raise ValueError(f"data_order={self.data_order!r}: accepted: 'shuffled', 'sequential'")
        if not isinstance(self.bf16, bool):
            raise TypeError(f"bf16={self.bf16!r}: accepted: True or False")

    @classmethod
    def from_hf(cls, hf_args: Any) -> "TrainingArguments":
        """The same fields read from a ``transformers.TrainingArguments`` (anything with ``to_dict()``).
        A field MegaTrain cannot honour, set to anything but Hugging Face's default, is refused by name."""
        from ._hf_fields import check_hf_arguments

        values = hf_args.to_dict() if hasattr(hf_args, "to_dict") else dict(vars(hf_args))
        ours = {f.name for f in dataclasses.fields(cls)}
        check_hf_arguments(values, ours)
        kwargs = {k: v for k, v in values.items() if k in ours}
        if kwargs.get("eval_steps") is not None and not isinstance(kwargs["eval_steps"], int):
            raise ValueError(f"eval_steps={kwargs['eval_steps']!r}: accepted: an integer number of steps (a fraction of the run is not supported)")
        for name in ("logging_steps", "save_steps"):
            v = kwargs.get(name)
            if isinstance(v, float):
                if v != int(v) or v < 1:
                    raise ValueError(f"{name}={v!r}: accepted: an integer number of steps (a fraction of the run is not supported)")
                kwargs[name] = int(v)
        w = kwargs.get("warmup_steps")
        if isinstance(w, float):
            # transformers 5: a warmup_steps below 1 is a ratio of the run's steps (ceil(ratio x steps)).
            if 0 < w < 1:
                if not values.get("max_steps") or values["max_steps"] <= 0:
                    raise ValueError(f"warmup_steps={w!r} is a ratio of the run's steps, which MegaTrain knows only from max_steps; "
                                     "accepted: an integer number of warmup steps, or a ratio with max_steps set")
                kwargs["warmup_steps"] = math.ceil(values["max_steps"] * w)
            elif w != int(w):
                raise ValueError(f"warmup_steps={w!r}: accepted: an integer number of steps, or a ratio below 1")
            else:
                kwargs["warmup_steps"] = int(w)
        # transformers 5's train_sampling_strategy: the order rows are drawn in.
        strategy = getattr(values.get("train_sampling_strategy"), "value", values.get("train_sampling_strategy"))
        if strategy is not None and "data_order" not in kwargs:
            orders = {"random": "shuffled", "sequential": "sequential"}
            if strategy not in orders:
                raise ValueError(f"TrainingArguments.train_sampling_strategy={strategy!r} is not supported by MegaTrain; "
                                 "accepted: 'random', 'sequential'")
            kwargs["data_order"] = orders[strategy]
        return cls(**kwargs)


@dataclass
class TrainerState:
    """Hugging Face's TrainerState fields that MegaTrain fills."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: float = 0.0
    logging_steps: int = 10
    eval_steps: Optional[int] = None
    save_steps: int = 500
    train_batch_size: int = 1
    log_history: List[Dict[str, Any]] = field(default_factory=list)
    best_metric: Optional[float] = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True


@dataclass
class TrainerControl:
    """What callbacks ask of the Trainer, as in Hugging Face: set a flag in on_step_end (or any event)."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self):
        self.should_training_stop = False

    def _new_step(self):
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False


def _is_torch_model(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "config") and hasattr(obj.config, "to_dict")


def _is_transformers_model(obj: Any) -> bool:
    """A transformers PreTrainedModel (not only something shaped like one)."""
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(obj).__mro__)


class Trainer:
    """Trains a model with MegaTrain's engine: the CUDA backend when a GPU is present, the CPU
    backend otherwise, the state in RAM or on NVMe as the plan places it.

    Args:
        model: an ``mt.Model``, a model folder or profile name, or a PyTorch model with
            ``.config.to_dict()`` and ``.state_dict()`` (a transformers PreTrainedModel): its config
            and weights are the initial state, and after ``train()`` its parameters hold the trained
            fp32 weights.
        args: ``mt.TrainingArguments`` or ``transformers.TrainingArguments``.
        train_dataset: ``mt.load_dataset(...)``, a path to a prepared dataset or token file, or a
            sequence of rows (``{"input_ids", "labels"}`` dicts or lists of ids).
        eval_dataset: the same kinds, for ``evaluate()`` and ``eval_steps``.
        callbacks: objects (or classes) with some of on_train_begin, on_step_begin, on_step_end,
            on_log, on_evaluate, on_save, on_train_end, called as ``(args, state, control, **kwargs)``.
    """

    def __init__(self, model: Any = None, args: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 callbacks: Optional[Sequence[Any]] = None, **kwargs: Any):
        if kwargs:
            raise ValueError(f"Trainer: {', '.join(sorted(kwargs))} not supported; accepted: model, args, train_dataset, "
                             "eval_dataset, callbacks")
        if model is None:
            raise ValueError("Trainer: model is required: an mt.Model, a model folder, a profile name or a PyTorch model")
        if args is None:
            raise ValueError("Trainer: args is required: mt.TrainingArguments(output_dir=...)")
        self.args = args if isinstance(args, TrainingArguments) else TrainingArguments.from_hf(args)
        self.model = model
        if isinstance(model, Model):
            self._model = model
        elif isinstance(model, (str, os.PathLike)):
            self._model = Model.from_pretrained(model)
        elif _is_torch_model(model):
            self._model = None  # exported on first use (_resolve_model)
        else:
            raise ValueError(f"model: {type(model).__name__} is not accepted; accepted: an mt.Model, a model folder or profile "
                             "name, or a PyTorch model with .config.to_dict() and .state_dict()")
        self.train_dataset = None if train_dataset is None else Dataset.coerce(train_dataset, "train_dataset")
        self.eval_dataset = None if eval_dataset is None else Dataset.coerce(eval_dataset, "eval_dataset")
        self.callbacks = [cb() if isinstance(cb, type) else cb for cb in (callbacks or [])]
        self.settings = config.settings()
        self.state = TrainerState()
        self.control = TrainerControl()
        self._resolved: Optional[Dict[str, Any]] = None
        self._lock_file = None  # the output_dir's lock while this Trainer writes or trains there
        self._lock_depth = 0
        self._last_checkpoint: Optional[str] = None
        self.output_dir = os.path.abspath(self.args.output_dir)

    # ---- callbacks -------------------------------------------------------------------------------
    def add_callback(self, callback: Any) -> None:
        """Adds a callback (an object, or a class to instantiate), called after those given to the constructor."""
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def _event(self, name: str, **kwargs: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, name, None)
            if fn is None:
                continue
            result = fn(self.args, self.state, self.control, model=self.model, **kwargs)
            if isinstance(result, TrainerControl):
                self.control = result

    # ---- planning --------------------------------------------------------------------------------
    def _resolve_model(self) -> Model:
        if self._model is None:
            self._model = _export_torch_model(self.model, os.path.join(self.output_dir, "initial-model"))
        return self._model

    def _seq_len(self, model: Model, dataset: Dataset) -> int:
        mpe = model.max_position_embeddings
        if self.args.max_seq_length is not None:
            if self.args.max_seq_length > mpe:
                raise ValueError(f"max_seq_length={self.args.max_seq_length}: the model's max_position_embeddings is {mpe}; accepted: 1 .. {mpe}")
            return self.args.max_seq_length
        natural = dataset.natural_seq_len()
        if natural is not None:
            return min(natural, mpe)
        return min(2048, mpe)

    @contextlib.contextmanager
    def _locked(self):
        """Holds <output_dir>/.megatrain-trainer.lock while this Trainer writes its plan and data there,
        and for the whole of train(): a second Trainer on the same output_dir is refused before it
        writes anything (it rewrote the running one's plan and data, which then stopped with "data
        file changed"). Reentrant within one Trainer."""
        if self._lock_depth == 0:
            import fcntl
            os.makedirs(self.output_dir, exist_ok=True)
            path = os.path.join(self.output_dir, ".megatrain-trainer.lock")
            f = open(path, "a+", encoding="utf-8")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                f.close()
                raise RuntimeError(f"output_dir {self.output_dir!r} is in use by another Trainer ({holder}); accepted: another "
                                   "output_dir, or the same once that Trainer has finished") from None
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()}\n")
            f.flush()
            self._lock_file = f
        self._lock_depth += 1
        try:
            yield
        finally:
            self._lock_depth -= 1
            if self._lock_depth == 0 and self._lock_file is not None:
                self._lock_file.close()  # closing the descriptor releases the flock
                self._lock_file = None

    def _write_inputs(self, r: Dict[str, Any]) -> None:
        """The run's data and plan files, (re)written under the lock: another Trainer may have written
        its own between this one's plan() and train()."""
        data_path = self.train_dataset.materialize(os.path.join(self.output_dir, "data"), r["seq_len"], r["model"].vocab_size, "train")
        if data_path != r["data"]:
            raise RuntimeError(f"the training data moved from {r['data']!r} to {data_path!r} between plan() and train()")
        _write_plan(r["plan_path"], r["plan"])

    def _resolve(self) -> Dict[str, Any]:
        if self._resolved is not None:
            return self._resolved
        with self._locked():
            return self._resolve_locked()

    def _resolve_locked(self) -> Dict[str, Any]:
        if self.train_dataset is None:
            raise ValueError("Trainer: train_dataset is required to plan and train")
        model = self._resolve_model()
        a = self.args
        seq_len = self._seq_len(model, self.train_dataset)
        data_dir = os.path.join(self.output_dir, "data")
        data_path = self.train_dataset.materialize(data_dir, seq_len, model.vocab_size, "train")
        info = self.train_dataset.info
        rows = int(info["rows"])
        per_step = a.per_device_train_batch_size * a.gradient_accumulation_steps
        if a.max_steps > 0:
            steps = a.max_steps
        else:
            per_epoch = max(1, math.ceil(rows / a.per_device_train_batch_size) // a.gradient_accumulation_steps)
            steps = max(1, math.ceil(a.num_train_epochs * per_epoch))
        if a.warmup_steps > steps:
            raise ValueError(f"warmup_steps={a.warmup_steps} exceeds the run's {steps} steps; accepted: 0 .. {steps}")
        rig = config.effective_rig(self.settings, self.output_dir, model.reference, seq_len)
        feasible, text, reason = errors.call(_megatrain.plan_search, model.reference, rig, seq_len, seq_len * per_step,
                                             a.per_device_train_batch_size, steps, self.settings.state_formats(),
                                             "bf16" if a.bf16 else "fp32", float(info.get("document_tokens", 0.0)))
        result = json.loads(text)
        if not feasible:
            raise PlanError(f"{model.name} with {a.per_device_train_batch_size} x {seq_len} tokens per micro-batch does not fit "
                            f"the rig {rig}: {reason}")
        plan = result["plan"]
        schedule = _SCHEDULERS[a.lr_scheduler_type]
        plan["training"].update({
            "steps": steps, "seed": a.seed, "lr": a.learning_rate, "lr_schedule": schedule, "warmup_steps": a.warmup_steps,
            "min_lr": 0.0, "clip_grad_norm": a.max_grad_norm, "data_order": a.data_order})
        plan["optimizer"].update({"beta1": a.adam_beta1, "beta2": a.adam_beta2, "eps": a.adam_epsilon, "weight_decay": a.weight_decay})
        os.makedirs(self.output_dir, exist_ok=True)
        plan_path = os.path.join(self.output_dir, "megatrain.plan.json")
        _write_plan(plan_path, plan)
        self._resolved = {"model": model, "seq_len": seq_len, "data": data_path, "rows": rows, "steps": steps, "rig": rig,
                          "plan_path": plan_path, "plan": plan, "result": result, "data_info": dict(info)}
        return self._resolved

    def _eval_file(self, dataset: Optional[Dataset]) -> str:
        r = self._resolve()
        ds = dataset if dataset is not None else self.eval_dataset
        if ds is None:
            raise ValueError("evaluate: no eval_dataset (give one to Trainer(...) or to evaluate(...))")
        name = "eval" if ds is self.eval_dataset else f"eval-{id(ds):x}"
        return ds.materialize(os.path.join(self.output_dir, "data"), r["seq_len"], r["model"].vocab_size, name)

    def plan(self) -> Dict[str, Any]:
        """The planner's choice for this model, batch shape and rig, before any training, as
        ``megatrain-plan plan --json`` gives it: "feasible", "plan" (with "predicted": step time,
        tokens/s, peak bytes per tier), "bottleneck", "alternatives", ... The plan carries this
        Trainer's hyperparameters. Raises mt.PlanError (a ValueError) naming the tier and the
        shortfall in bytes when nothing fits."""
        r = self._resolve()
        out = json.loads(json.dumps(r["result"]))
        with open(r["plan_path"], encoding="utf-8") as f:
            out["plan"] = json.load(f)
        return out

    # ---- training --------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str:
        """Where train() writes its checkpoints (``<output_dir>/checkpoints/step-NNNNNNNN``)."""
        return os.path.join(self.output_dir, "checkpoints")

    def _resume_dir(self, resume_from_checkpoint: Union[bool, str, None]) -> Optional[str]:
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        if resume_from_checkpoint is True:
            if errors.call(_megatrain.latest_checkpoint, self.checkpoint_dir) is None:
                raise CheckpointError(f"resume_from_checkpoint=True: no checkpoint in {self.checkpoint_dir}")
            return self.checkpoint_dir
        path = os.path.abspath(os.fspath(resume_from_checkpoint))
        if not os.path.exists(path):
            raise FileNotFoundError(f"resume_from_checkpoint={path!r}: no such folder")
        folder = os.path.dirname(path) if os.path.isfile(os.path.join(path, "manifest.json")) else path
        if os.path.realpath(folder) != os.path.realpath(self.checkpoint_dir):
            raise ValueError(f"resume_from_checkpoint={path!r}: this Trainer's checkpoints are in {self.checkpoint_dir}; accepted: "
                             "True, that folder, or its newest step folder (or an output_dir whose checkpoints these are)")
        newest = errors.call(_megatrain.latest_checkpoint, folder)
        if newest is None:
            raise CheckpointError(f"resume_from_checkpoint={path!r}: no checkpoint there")
        if folder != path and os.path.realpath(newest) != os.path.realpath(path):
            raise ValueError(f"resume_from_checkpoint={path!r}: the newest checkpoint is {newest}, and a run resumes from the "
                             "newest; accepted: True, the checkpoint folder or its newest step folder")
        return folder

    def train(self, resume_from_checkpoint: Union[bool, str, None] = None) -> TrainOutput:
        """Trains for ``max_steps`` (or ``num_train_epochs``) optimizer steps and returns
        TrainOutput(global_step, training_loss, metrics). Checkpoints go to ``checkpoint_dir`` every
        ``save_steps``, at the end, when a callback sets ``control.should_save`` or
        ``should_training_stop``, and on Ctrl-C (then KeyboardInterrupt is raised). With
        ``resume_from_checkpoint`` (True or the checkpoint folder) the run continues bit for bit
        from the newest checkpoint."""
        with self._locked():
            return self._train_locked(resume_from_checkpoint)

    def _train_locked(self, resume_from_checkpoint: Union[bool, str, None]) -> TrainOutput:
        resume = self._resume_dir(resume_from_checkpoint)
        fresh = self._resolved is None
        r = self._resolve()
        if not fresh:
            self._write_inputs(r)
        a = self.args
        model = r["model"]
        info = r["data_info"]
        if "padded" in info:
            _say(f"data: {info['rows']} rows of {r['seq_len']} tokens: {info['padded']} shorter rows padded (the padding does "
                 f"not count), {info['truncated']} longer rows truncated")
        options = {"plan": r["plan_path"], "data": r["data"], "checkpoint_dir": self.checkpoint_dir, "steps": r["steps"],
                   "resume": resume is not None, "backend": "auto", "keep_checkpoints": a.save_total_limit or 0}
        if resume is None and model.weights is not None:
            options["init"] = model.weights
        if self.eval_dataset is not None:
            options["eval_data"] = self._eval_file(None)
        first = 0
        if resume is not None:
            newest = errors.call(_megatrain.latest_checkpoint, self.checkpoint_dir)
            m = re.search(r"step-(\d+)$", newest or "")
            first = int(m.group(1)) if m else 0
        self.state = TrainerState(global_step=first, max_steps=r["steps"], num_train_epochs=a.num_train_epochs,
                                  logging_steps=a.logging_steps, eval_steps=a.eval_steps, save_steps=a.save_steps,
                                  train_batch_size=a.per_device_train_batch_size, epoch=self._epoch(first))
        if resume is not None:  # the log of the steps the checkpoint holds, as Hugging Face restores it
            self.state.log_history = [e for e in self._saved_log() if e.get("step", 0) <= first]
        self.control._new_training()
        run_losses: List[float] = []
        window = {"loss": 0.0, "steps": 0, "tokens": 0, "positions": 0, "time": 0.0}
        positions_per_step = r["seq_len"] * a.per_device_train_batch_size * a.gradient_accumulation_steps
        start = time.monotonic()
        trainer = self

        class Hooks:
            @staticmethod
            def before_step(step: int) -> None:
                trainer.control._new_step()
                trainer._event("on_step_begin")

            @staticmethod
            def after_step(d: Dict[str, Any]):
                st = trainer.state
                st.global_step = d["step"] + 1
                st.epoch = trainer._epoch(st.global_step)
                if d["applied"]:
                    run_losses.append(d["loss"])
                    window["loss"] += d["loss"]
                    window["steps"] += 1
                window["tokens"] += d["tokens"]
                window["positions"] += positions_per_step
                window["time"] += d["time_s"]
                trainer._event("on_step_end")
                c = trainer.control
                if a.logging_steps > 0 and st.global_step % a.logging_steps == 0:
                    c.should_log = True
                if a.eval_steps and trainer.eval_dataset is not None and st.global_step % a.eval_steps == 0:
                    c.should_evaluate = True
                if a.save_steps > 0 and st.global_step % a.save_steps == 0:
                    c.should_save = True
                if st.global_step >= st.max_steps:
                    c.should_training_stop = True
                    c.should_save = True
                if c.should_log:
                    logs = {"loss": window["loss"] / window["steps"] if window["steps"] else float("nan"),
                            "grad_norm": d["grad_norm"], "learning_rate": d["learning_rate"],
                            # every position of the rows, as the plan counts; and the counted targets
                            "tokens_per_second": window["positions"] / window["time"] if window["time"] > 0 else 0.0,
                            "targets_per_second": window["tokens"] / window["time"] if window["time"] > 0 else 0.0,
                            "epoch": st.epoch}
                    window.update(loss=0.0, steps=0, tokens=0, positions=0, time=0.0)
                    trainer.log(logs)
                evaluate = bool(c.should_evaluate and trainer.eval_dataset is not None)
                stop = c.should_training_stop and st.global_step < st.max_steps
                return bool(c.should_save), bool(stop), evaluate

            @staticmethod
            def after_eval(next_step: int, loss: float, tokens: int, time_s: float) -> None:
                trainer._evaluated(loss, tokens, time_s)

            @staticmethod
            def after_save(next_step: int, folder: str) -> None:
                trainer._last_checkpoint = folder
                trainer._save_log()
                trainer.control.should_save = False
                trainer._event("on_save", checkpoint=folder)

        self._event("on_train_begin")
        try:
            with _stop_signals_save():
                summary = _megatrain.run(options, Hooks(), _say)
        except _megatrain.StatusError as e:
            raise errors.from_status(e) from None
        except KeyboardInterrupt:
            # The run saved a checkpoint at the step boundary; the signal may have landed inside a
            # step's hook, before it counted the step: the state follows the checkpoint.
            newest = errors.call(_megatrain.latest_checkpoint, self.checkpoint_dir)
            m = re.search(r"step-(\d+)$", newest or "")
            if m:
                self._last_checkpoint = newest
                self.state.global_step = max(self.state.global_step, int(m.group(1)))
                self.state.epoch = self._epoch(self.state.global_step)
            raise
        runtime = time.monotonic() - start
        self._last_checkpoint = errors.call(_megatrain.latest_checkpoint, self.checkpoint_dir) or self._last_checkpoint
        done = summary["next_step"] - summary["first_step"]
        training_loss = sum(run_losses) / len(run_losses) if run_losses else float("nan")
        samples = done * a.per_device_train_batch_size * a.gradient_accumulation_steps
        metrics = {"train_runtime": runtime, "train_samples_per_second": samples / runtime if runtime > 0 else 0.0,
                   "train_steps_per_second": done / runtime if runtime > 0 else 0.0, "train_loss": training_loss,
                   "epoch": self.state.epoch}
        self.state.global_step = summary["next_step"]
        self.state.log_history.append(dict(metrics, step=self.state.global_step))
        self._event("on_train_end")
        if _is_torch_model(self.model) and self._last_checkpoint is not None:
            _copy_into_torch_model(self.model, os.path.join(self._last_checkpoint, "model.safetensors"))
        return TrainOutput(self.state.global_step, training_loss, metrics)

    @property
    def _state_file(self) -> str:
        return os.path.join(self.output_dir, "trainer_state.json")

    def _save_log(self) -> None:
        """state.log_history and global_step to <output_dir>/trainer_state.json (atomically), so that
        a resumed run's log_history starts with the steps its checkpoint holds."""
        tmp = self._state_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"global_step": self.state.global_step, "max_steps": self.state.max_steps,
                       "log_history": self.state.log_history}, f, indent=1)
        os.replace(tmp, self._state_file)

    def _saved_log(self) -> List[Dict[str, Any]]:
        try:
            with open(self._state_file, encoding="utf-8") as f:
                return list(json.load(f).get("log_history", []))
        except (OSError, ValueError):
            return []

    def _epoch(self, step: int) -> float:
        rows = self._resolved["rows"] if self._resolved else 0
        a = self.args
        return step * a.per_device_train_batch_size * a.gradient_accumulation_steps / rows if rows else 0.0

    def log(self, logs: Dict[str, float]) -> None:
        """Appends ``logs`` (with the step) to state.log_history and calls on_log."""
        entry = dict(logs, step=self.state.global_step)
        self.state.log_history.append(entry)
        self._event("on_log", logs=logs)

    def _evaluated(self, loss: float, tokens: int, time_s: float) -> Dict[str, float]:
        metrics = {"eval_loss": loss, "eval_tokens": tokens, "eval_runtime": time_s,
                   "eval_tokens_per_second": tokens / time_s if time_s > 0 else 0.0, "epoch": self.state.epoch}
        self.control.should_evaluate = False
        self.log(metrics)
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def evaluate(self, eval_dataset: Any = None) -> Dict[str, float]:
        """A forward-only pass over every row of ``eval_dataset`` (default: the Trainer's) with the
        current weights (the newest checkpoint's, or the initial ones before training), streamed
        through the same engine as training. Returns {"eval_loss": the mean loss over the counted
        targets, "eval_tokens", "eval_runtime", "eval_tokens_per_second", "epoch"}, logs it and
        calls on_log and on_evaluate."""
        ds = None if eval_dataset is None else Dataset.coerce(eval_dataset, "eval_dataset")
        r = self._resolve()
        options = {"plan": r["plan_path"], "data": r["data"], "eval_data": self._eval_file(ds), "eval_only": True,
                   "backend": "auto", "steps": r["steps"]}
        if errors.call(_megatrain.latest_checkpoint, self.checkpoint_dir) is not None:
            options.update(checkpoint_dir=self.checkpoint_dir, resume=True)
        elif r["model"].weights is not None:
            options["init"] = r["model"].weights
        try:
            summary = _megatrain.run(options, None, _say)
        except _megatrain.StatusError as e:
            raise errors.from_status(e) from None
        e = summary["evals"][-1]
        return self._evaluated(e["loss"], e["tokens"], e["time_s"])

    # ---- saving ----------------------------------------------------------------------------------
    def save_model(self, output_dir: Optional[str] = None) -> str:
        """Writes config.json and model.safetensors (Hugging Face names, fp32) of the newest
        checkpoint to ``output_dir`` (default: args.output_dir); transformers' from_pretrained
        loads the folder. Returns the folder."""
        target = os.path.abspath(os.fspath(output_dir or self.output_dir))
        source = self._last_checkpoint or errors.call(_megatrain.latest_checkpoint, self.checkpoint_dir)
        if source is None:
            raise ValueError(f"save_model: nothing trained yet (no checkpoint in {self.checkpoint_dir}); call train() first")
        os.makedirs(target, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            src, dst = os.path.join(source, name), os.path.join(target, name)
            tmp = dst + ".tmp"
            if os.path.exists(tmp):
                os.unlink(tmp)
            try:
                os.link(src, tmp)
            except OSError:
                shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        return target


def _write_plan(path: str, plan: Dict[str, Any]) -> None:
    """The plan file, replaced whole (a reader never sees half of it)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(plan, f, indent=1)
    os.replace(tmp, path)


class _stop_signals_save:
    """While train() runs, SIGTERM and SIGHUP (a scheduler's stop, a dropped ssh session) stop the run
    as Ctrl-C does: at the next step boundary, with a checkpoint, then KeyboardInterrupt naming the
    signal; megatrain-exec saves on both the same way. Without this they ended the process without
    saving. Handlers can only be set from the main thread; elsewhere the process's are kept."""

    def __enter__(self):
        import signal
        import threading
        self._old = {}
        if threading.current_thread() is not threading.main_thread():
            return self

        def stop(signum, frame):
            raise KeyboardInterrupt(f"{signal.Signals(signum).name}: the run saves a checkpoint at the next step boundary and stops")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old[sig] = signal.signal(sig, stop)
        return self

    def __exit__(self, *exc):
        import signal
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def _say(line: str) -> None:
    print(line, flush=True)


def _export_torch_model(model: Any, folder: str) -> Model:
    """A PyTorch model's config and weights as a Hugging Face folder (config.json and safetensors:
    a transformers model in its own dtype by its own save_pretrained, another model in fp32), from
    which the run starts."""
    if _is_transformers_model(model):
        # transformers' own writer: its state dict may differ from the checkpoint format (transformers
        # 5 keeps Mixtral's and Qwen3-MoE's experts fused in memory and writes them one by one).
        os.makedirs(folder, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        return Model.from_pretrained(folder)
    cfg = model.config.to_dict()
    sd = model.state_dict()
    tied = bool(cfg.get("tie_word_embeddings", False))
    tensors = []
    for name, t in sd.items():
        if tied and name == "lm_head.weight":
            continue
        tensors.append((name, t.detach().to("cpu").float().contiguous().numpy()))
    os.makedirs(folder, exist_ok=True)
    errors.call(_megatrain.write_safetensors, os.path.join(folder, "model.safetensors"), tensors)
    tmp = os.path.join(folder, "config.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1, default=str)
    os.replace(tmp, os.path.join(folder, "config.json"))
    return Model.from_pretrained(folder)


def _copy_into_torch_model(model: Any, safetensors_path: str) -> None:
    """The trained weights into the PyTorch model's parameters, in place (their dtype and device kept)."""
    import torch

    if _is_transformers_model(model):
        # Read back by transformers itself (the checkpoint's names are the published ones).
        folder = os.path.dirname(safetensors_path)
        loaded = type(model).from_pretrained(folder, dtype=torch.float32)
        params = dict(loaded.state_dict())
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if name not in params:
                    raise CheckpointError(f"{folder} has no tensor {name!r} of the model")
                t.copy_(params[name].to(dtype=t.dtype, device=t.device))
        return
    trained = errors.call(_megatrain.read_safetensors, safetensors_path)
    tied = bool(model.config.to_dict().get("tie_word_embeddings", False))
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name not in trained:
                if tied and name == "lm_head.weight":
                    continue
                raise CheckpointError(f"{safetensors_path} has no tensor {name!r} of the model")
            t.copy_(torch.from_numpy(trained[name]).to(dtype=t.dtype, device=t.device))
