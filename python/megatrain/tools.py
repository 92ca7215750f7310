"""``mt.inspect``, ``mt.simulate`` and ``mt.size``: the planner's answers as dicts, with the keys of
``megatrain-plan inspect|simulate|size --json``."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Union

from . import _megatrain, errors
from .model import Model

__all__ = ["inspect", "simulate", "size"]


def _model_ref(model: Union[str, Model, Any]) -> str:
    if isinstance(model, Model):
        return model.reference
    if isinstance(model, (str, os.PathLike)):
        p = os.fspath(model)
        return os.path.abspath(p) if os.path.exists(p) else p
    raise ValueError(f"model: {type(model).__name__} is not accepted; accepted: an mt.Model, a model folder or config.json, "
                     "or a name in profiles/models")


def _count(name: str, value: Optional[int]) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: accepted: a positive integer, or None")
    return value


def inspect(model: Union[str, Model], seq: Optional[int] = None) -> Dict[str, Any]:
    """What a model is, in numbers (``megatrain-plan inspect --json``): parameters, FLOPs per token,
    training-state bytes per precision setup and activation bytes at ``seq`` tokens (default: the
    model's max_position_embeddings)."""
    return json.loads(errors.call(_megatrain.inspect_json, _model_ref(model), _count("seq", seq), False))


def simulate(plan: Union[str, Dict[str, Any]]) -> Dict[str, Any]:
    """A plan's simulated training step (``megatrain-plan simulate --json``): step time, tokens/s,
    the bottleneck and peak bytes per tier. ``plan`` is a plan file or a plan dict (as
    ``Trainer.plan()["plan"]``). Raises mt.PlanError when the plan does not fit its rig."""
    from .errors import PlanError

    if isinstance(plan, dict):
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(plan, f)
            path = f.name
        try:
            feasible, text, reason = errors.call(_megatrain.simulate_json, path)
        finally:
            os.unlink(path)
    else:
        feasible, text, reason = errors.call(_megatrain.simulate_json, os.fspath(plan))
    if not feasible:
        raise PlanError(f"the plan does not fit: {reason}")
    return json.loads(text)


def size(model: Union[str, Model], gpu: Optional[str] = None, target_tokens_per_s: Optional[float] = None, seq: Optional[int] = None,
         tokens_per_step: Optional[int] = None, state_formats: str = "fp32") -> Dict[str, Any]:
    """Which rigs train a model (``megatrain-plan size --model M --json``): per GPU, the smallest host
    (RAM, NVMe drives, PCIe) whose plan fits, meeting ``target_tokens_per_s`` when given. ``gpu``
    filters the GPUs by name."""
    if target_tokens_per_s is not None and not (isinstance(target_tokens_per_s, (int, float)) and target_tokens_per_s > 0):
        raise ValueError(f"target_tokens_per_s={target_tokens_per_s!r}: accepted: a positive number, or None")
    return json.loads(errors.call(_megatrain.size_json, _model_ref(model), gpu or "", float(target_tokens_per_s or 0),
                                  _count("seq", seq), _count("tokens_per_step", tokens_per_step), state_formats))
