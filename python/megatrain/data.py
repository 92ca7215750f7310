"""Training data for ``mt.Trainer``: ``mt.load_dataset`` (megatrain-data's loader), token files, and
Python rows in Hugging Face's causal-LM shape.

Every kind ends as a file the training run maps: a prepared dataset (rows of seq_len + 1 tokens with
a mask of the counted targets, docs/data.md) or a token file. Python rows are written as a prepared
dataset: row ``input_ids`` of n tokens becomes the first n tokens of a row, and the target at
position t (which predicts token t + 1) counts when ``labels[t + 1]`` is not -100: the loss of
Hugging Face's causal LM, where the labels are shifted inside the model.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np

from . import _megatrain, errors

__all__ = ["Dataset", "load_dataset", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_FIELD_NAMES = ("text", "instruction", "input", "output", "messages", "role", "content")


class Dataset:
    """Rows to train or evaluate on. Build one with ``mt.load_dataset``, ``Dataset.from_file`` or
    ``Dataset.from_rows``; ``mt.Trainer`` also takes a path or a sequence of rows directly."""

    def __init__(self, kind: str, **spec: Any):
        self._kind = kind  # "rows" | "file" | "text"
        self._spec = spec
        self.info: Dict[str, Any] = {}  # what preparing it found (rows, padded, truncated, ...)

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str) -> "Dataset":
        """A prepared dataset (``megatrain-data prepare``) or a token file (llm.c .bin, raw .u16/.u32)."""
        path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dataset {path!r}: no such file; accepted: a prepared dataset (.mtseq) or a token file")
        return cls("file", path=path)

    @classmethod
    def from_rows(cls, rows: Sequence[Any]) -> "Dataset":
        """Rows as Hugging Face's causal-LM datasets hold them: dicts with ``input_ids`` and optional
        ``labels`` (-100: not counted) and ``attention_mask`` (ones, then trailing zeros for padding),
        or plain lists of token ids (every next token counts). Rows with ``position_ids`` (as
        transformers' DataCollatorWithFlattening and TRL's padding-free packing make them: 0 where
        a document begins, then counting up) pack several documents that attend only to themselves
        (packing "neat")."""
        if isinstance(rows, (str, bytes, os.PathLike)) or not hasattr(rows, "__len__") or not hasattr(rows, "__getitem__"):
            raise ValueError("train_dataset: accepted: mt.load_dataset(...), a path to a prepared dataset or token file, "
                             "or a sequence of rows ({'input_ids': [...], 'labels': [...]} or lists of ids)")
        if len(rows) == 0:
            raise ValueError("the dataset has no rows")
        return cls("rows", rows=rows)

    @classmethod
    def coerce(cls, data: Any, what: str = "train_dataset") -> "Dataset":
        if isinstance(data, Dataset):
            return data
        if isinstance(data, (str, os.PathLike)):
            return cls.from_file(data)
        try:
            return cls.from_rows(data)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None

    # ---- what the trainer needs --------------------------------------------------------------------
    def natural_seq_len(self) -> Optional[int]:
        """The sequence length (input positions per row) the data implies: a prepared file's, the
        longest row's; None for text and token files (the trainer then uses max_seq_length or the
        model's default)."""
        if self._kind == "rows":
            return max(len(_row_ids(r, i)) for i, r in enumerate(self._spec["rows"]))
        if self._kind == "file":
            h = errors.call(_megatrain.sequence_header, self._spec["path"])
            return None if h is None else int(h["seq_len"])
        return None

    def materialize(self, work_dir: str, seq_len: int, vocab_size: int, name: str) -> str:
        """The file the run reads, for rows of seq_len inputs (+1 for the last target)."""
        if self._kind == "file":
            path = self._spec["path"]
            h = errors.call(_megatrain.sequence_header, path)
            if h is not None and int(h["seq_len"]) != seq_len:
                raise ValueError(f"{path}: prepared with seq_len {h['seq_len']}, and this run's is {seq_len}; accepted: "
                                 f"max_seq_length={h['seq_len']} (or prepare the data again)")
            self.info = dict(h or {}, rows=errors.call(_megatrain.rows_per_epoch, path, seq_len))
            return path
        os.makedirs(work_dir, exist_ok=True)
        if self._kind == "text":
            s = self._spec
            key = hashlib.sha256(repr((s, seq_len)).encode()).hexdigest()[:16]
            out = os.path.join(work_dir, f"{name}-{key}.mtseq")
            if not os.path.isfile(out):
                self.info = errors.call(_megatrain.prepare_dataset, s["tokenizer"], s["paths"], s["format"], s["fields"], seq_len,
                                        s["packing"], s["split_long"], s["train_on"] or "", s["chat_template"] or "", out)
            else:
                self.info = dict(errors.call(_megatrain.sequence_header, out))
            return out
        tokens, mask, stats = rows_to_arrays(self._spec["rows"], seq_len, vocab_size)
        out = os.path.join(work_dir, f"{name}.mtseq")
        document_tokens = errors.call(_megatrain.write_sequences, out, tokens, mask, vocab_size, -1, stats["pad_id"], len(tokens),
                                      stats["truncated"], stats["tokens"], "all", "python rows", stats["packing"])
        self.info = dict(stats, rows=len(tokens), seq_len=seq_len, document_tokens=document_tokens)
        return out

    def __len__(self) -> int:
        if self._kind == "rows":
            return len(self._spec["rows"])
        raise TypeError("the row count of a file dataset is known once the sequence length is (Trainer.plan())")

    def __repr__(self) -> str:
        if self._kind == "rows":
            return f"megatrain.Dataset({len(self._spec['rows'])} rows)"
        if self._kind == "file":
            return f"megatrain.Dataset({self._spec['path']!r})"
        return f"megatrain.Dataset({self._spec['paths']!r}, tokenizer={self._spec['tokenizer']!r})"


# load_dataset's formats and megatrain-data's names for them ("chat" is the documented name of
# role/content messages, which the loader calls "messages").
_FORMATS = {"auto": "auto", "text": "text", "alpaca": "alpaca", "chat": "messages", "messages": "messages",
            "sharegpt": "sharegpt", "plain": "plain"}


def load_dataset(path: Union[str, Sequence[str]], tokenizer: Optional[str] = None, format: str = "auto", packing: str = "neat",
                 train_on: Optional[str] = None, split_long: bool = False, chat_template: Optional[str] = None,
                 fields: Optional[Dict[str, str]] = None) -> Dataset:
    """A dataset file (or several) for training, tokenized by megatrain-data's loader when the
    Trainer knows its sequence length.

    Args:
        path: a JSON Lines, JSON or text file (or a list of them), or a prepared dataset / token
            file (then ``tokenizer`` is not needed).
        tokenizer: a model folder with tokenizer.json (and tokenizer_config.json for chat templates).
        format: "auto", "text", "alpaca", "chat" or "sharegpt" (megatrain-data prepare --format).
        packing: "neat" (documents end to end, each attending only to itself with its positions
            from 0, as transformers' flattening collator and LLaMA-Factory's neat_packing; the
            default), "pack" (end to end, each attending to the ones before it in its row, as
            transformers' group_texts) or "pad" (one document per row).
        train_on: "all" or "assistant"; None: assistant answers for alpaca and chat, all otherwise.
        split_long: with packing "pad", a document longer than a row goes on in further rows.
        chat_template: a Jinja template's source to use instead of the tokenizer's.
        fields: other field names, e.g. {"text": "content"} (keys: text, instruction, input,
            output, messages, role, content).
    """
    paths = [os.fspath(path)] if isinstance(path, (str, os.PathLike)) else [os.fspath(p) for p in path]
    if not paths:
        raise ValueError("load_dataset: no path given")
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"dataset {p!r}: no such file")
    if tokenizer is None:
        if len(paths) != 1:
            raise ValueError("load_dataset: several files need tokenizer=<model folder with tokenizer.json>")
        return Dataset.from_file(paths[0])
    if not isinstance(format, str) or format not in _FORMATS:
        raise ValueError(f"format={format!r}: accepted: {', '.join(repr(k) for k in _FORMATS)}")
    format = _FORMATS[format]
    if packing not in ("pack", "neat", "pad"):
        raise ValueError(f"packing={packing!r}: accepted: 'pack', 'neat', 'pad'")
    if train_on not in (None, "all", "assistant", "answer"):
        raise ValueError(f"train_on={train_on!r}: accepted: None, 'all', 'assistant'")
    fields = dict(fields or {})
    for k in fields:
        if k not in _FIELD_NAMES:
            raise ValueError(f"fields: {k!r} is not a field; accepted: {', '.join(_FIELD_NAMES)}")
    tokenizer = os.path.abspath(os.fspath(tokenizer))
    if not os.path.exists(tokenizer):
        raise FileNotFoundError(f"tokenizer {tokenizer!r}: no such folder")
    return Dataset("text", paths=[os.path.abspath(p) for p in paths], tokenizer=tokenizer, format=format, packing=packing,
                   train_on=train_on, split_long=bool(split_long), chat_template=chat_template, fields=fields)


def _row_ids(row: Any, index: int) -> np.ndarray:
    ids = row.get("input_ids") if isinstance(row, dict) else row
    if ids is None:
        raise ValueError(f"row {index}: a dict without 'input_ids'; accepted: {{'input_ids': [...], 'labels': [...]}} or a list of ids")
    try:
        arr = np.asarray(ids.tolist() if hasattr(ids, "tolist") else ids)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"row {index}: input_ids must be a list of integer token ids")
    arr = arr.astype(np.int64, copy=False)
    if isinstance(row, dict) and row.get("attention_mask") is not None:
        am = np.asarray(row["attention_mask"].tolist() if hasattr(row["attention_mask"], "tolist") else row["attention_mask"])
        n = int((am != 0).sum()) if am.ndim == 1 else -1
        if am.ndim != 1 or len(am) != len(arr) or not (am[:n] == 1).all() or not (am[n:] == 0).all():
            raise ValueError(f"row {index}: attention_mask must be ones followed by zeros (right padding) as long as input_ids")
        arr = arr[:n]
    return arr


def _document_starts(row: Any, i: int, m: int) -> Optional[np.ndarray]:
    """The positions where a packed row's documents begin, from its ``position_ids`` (transformers'
    DataCollatorWithFlattening: 0 where a document begins, then counting up) over its first m
    tokens; None for a row without them."""
    pos = row.get("position_ids") if isinstance(row, dict) else None
    if pos is None:
        return None
    pos = np.asarray(pos.tolist() if hasattr(pos, "tolist") else list(pos), dtype=np.int64).reshape(-1)
    if len(pos) < m:
        raise ValueError(f"row {i}: {len(pos)} position_ids for {m} input_ids; accepted: one per input id")
    pos = pos[:m]
    ok = (pos == 0) | (np.concatenate(([False], pos[1:] == pos[:-1] + 1)))
    if not ok.all() or pos[0] != 0:
        t = 0 if pos[0] != 0 else int(np.flatnonzero(~ok)[0])
        raise ValueError(f"row {i}: position_ids[{t}] is {int(pos[t])}; accepted: 0 where a document begins, else the previous "
                         "position + 1 (transformers' DataCollatorWithFlattening)")
    return np.flatnonzero(pos == 0)


def rows_to_arrays(rows: Sequence[Any], seq_len: int, vocab_size: int):
    """Rows as a prepared dataset's arrays: tokens and mask, len(rows) x (seq_len + 1). Rows shorter
    than seq_len are padded (the padding never counts), longer ones truncated to seq_len tokens."""
    n = len(rows)
    tokens = np.zeros((n, seq_len + 1), dtype=np.uint32)
    mask = np.zeros((n, seq_len + 1), dtype=np.uint8)
    truncated = padded = real = 0
    neat = False
    for i in range(n):
        row = rows[i]
        ids = _row_ids(row, i)
        labels = row.get("labels") if isinstance(row, dict) else None
        if labels is not None:
            labels = np.asarray(labels.tolist() if hasattr(labels, "tolist") else list(labels), dtype=np.int64)
            if labels.ndim != 1 or len(labels) < len(ids):
                raise ValueError(f"row {i}: {len(labels)} labels for {len(ids)} input_ids; accepted: one label per input id")
            labels = labels[:len(ids)]
        if len(ids) == 0:
            raise ValueError(f"row {i}: no tokens")
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            raise ValueError(f"row {i}: token id {int(ids[bad][0])} is outside the model's vocabulary 0..{vocab_size - 1}")
        if len(ids) > seq_len:
            truncated += 1
            ids = ids[:seq_len]
            labels = labels[:seq_len] if labels is not None else None
        elif len(ids) < seq_len:
            padded += 1
        m = len(ids)
        real += m
        tokens[i, :m] = ids
        if labels is None:
            mask[i, 1:m] = 1
        else:
            counted = labels[1:] != IGNORE_INDEX
            wrong = counted & (labels[1:] != ids[1:])
            if wrong.any():
                t = int(np.flatnonzero(wrong)[0]) + 1
                raise ValueError(f"row {i}: labels[{t}] is {int(labels[t])}, and input_ids[{t}] is {int(ids[t])}; accepted: a label "
                                 f"equal to the input id at the same position (the model shifts them), or -100 (not counted)")
            mask[i, 1:m] = counted
        starts = _document_starts(row, i, m)
        if starts is not None:  # each document's first token: a start (kMaskDocStart = 2), no one's target
            mask[i, starts] = 2
            neat = True
    return tokens, mask, {"truncated": truncated, "padded": padded, "tokens": real, "pad_id": 0,
                          "packing": "neat" if neat else "pad"}
