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

    def logits(self, input_ids: Any, checkpoint: Optional[str] = None, threads: int = 1, position_ids: Any = None) -> Any:
        """The model's logits for token rows, as transformers' ``model(input_ids).logits`` gives them:
        a float32 NumPy array [rows, seq_len, vocab_size]. ``input_ids``: rows of equal length (a
        list of lists or a 2-D array); each row attends causally to itself from position 0.
        ``position_ids`` of the same shape, as transformers' flattening collator makes them (0 where
        a document begins, then counting up), packs documents into a row without cross-document
        attention: each attends only to itself, its positions restarting at 0.

        The weights are the folder's (``from_pretrained``), or ``checkpoint``'s: a folder with
        model.safetensors that training or ``save_model`` wrote. Computed on the CPU by the same
        layers the CPU backend trains with, with the whole model in RAM: meant for checking a model,
        not for serving it. Raises ValueError naming a token outside the vocabulary or a bad shape.
        """
        import numpy as np

        weights = os.fspath(checkpoint) if checkpoint is not None else self._weights
        if weights is None:
            raise ValueError(f"{self.name}: no weights to compute logits with (a profile name is randomly initialised by "
                             "training); accepted: a model folder with model.safetensors, or checkpoint=<folder>")
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids: rows of equal length of integer token ids are accepted, not shape {ids.shape} "
                             f"of {ids.dtype}")
        pos = None
        if position_ids is not None:
            pos = np.asarray(position_ids)
            if pos.shape != ids.shape or not np.issubdtype(pos.dtype, np.integer):
                raise ValueError(f"position_ids: integers of input_ids' shape {ids.shape} are accepted, not {pos.shape} of {pos.dtype}")
            pos = pos.astype(np.int64)
        return errors.call(_megatrain.forward_logits, self._ref, weights, ids.astype(np.int64), threads, pos)

    def __repr__(self) -> str:
        return f"megatrain.Model({self.name!r}, {self.num_parameters:,} parameters, weights={self._weights!r})"
