"""``mt.Model``: a model MegaTrain trains, from a Hugging Face folder or a name in profiles/models."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from . import _megatrain, errors

__all__ = ["Model"]


class Model:
    """A model: its Hugging Face config and where its initial weights come from.

    Build one with ``Model.from_pretrained``. Nothing is loaded into memory: the weights are read
    (and MXFP4 experts dequantised) by the training run itself, which maps the safetensors files.
    """

    def __init__(self, ref: str, info: Dict[str, Any], weights: Optional[str]):
        self._ref = ref
        self._info = info
        self._weights = weights
        self.config: Dict[str, Any] = json.loads(info["config_json"])

    @classmethod
    def from_pretrained(cls, path: str) -> "Model":
        """A Hugging Face model folder (config.json and model.safetensors, or a sharded index; MXFP4
        expert weights included), a config.json file, or a name in profiles/models (randomly
        initialised from the training seed). Needs no PyTorch.

        Raises FileNotFoundError naming the path when it does not exist, ValueError when the config
        or weights are not accepted.
        """
        path = os.fspath(path)
        if os.path.exists(path):
            path = os.path.abspath(path)
        info = errors.call(_megatrain.model_info, path)
        weights = None
        folder = path if os.path.isdir(path) else os.path.dirname(path) if os.path.exists(path) else None
        if folder is not None and any(
                os.path.isfile(os.path.join(folder, f)) for f in ("model.safetensors", "model.safetensors.index.json")):
            weights = folder
        return cls(path, info, weights)

    @property
    def name(self) -> str:
        """The model's name (its folder's name, or the profile's)."""
        return self._info["name"]

    @property
    def num_parameters(self) -> int:
        """Parameters, counted as the planner counts them (published figures for shipped models)."""
        return int(self._info["parameters"])

    @property
    def reference(self) -> str:
        """What plans name as their model: the folder, file or profile name."""
        return self._ref

    @property
    def weights(self) -> Optional[str]:
        """The folder the initial weights are read from; None: random initialisation."""
        return self._weights

    @property
    def max_position_embeddings(self) -> int:
        return int(self._info["max_position_embeddings"])

    @property
    def vocab_size(self) -> int:
        return int(self._info["vocab_size"])

    def __repr__(self) -> str:
        return f"megatrain.Model({self.name!r}, {self.num_parameters:,} parameters, weights={self._weights!r})"
