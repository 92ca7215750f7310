"""``mt.init``: the process-wide defaults every Trainer starts from, and the rig they make."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Optional, Union

from . import errors

__all__ = ["init", "Settings", "settings"]

# The state formats optimizer_compression may name (docs/python.md); True lets the planner choose
# among the lossy ones (and fp32 where it fits as fast).
_LOSSY_FORMATS = ("bf16", "q8", "q4")
_GIB = float(1 << 30)


@dataclass
class Settings:
    """What ``mt.init`` set (``mt.settings()`` returns the current ones)."""

    offload_dir: Optional[str] = None
    max_vram_gb: Optional[float] = None
    max_ram_gb: Optional[float] = None
    optimizer_compression: Union[bool, str] = False
    rig: Optional[str] = None

    def state_formats(self) -> str:
        """The planner's state-format policy (``megatrain-plan plan --state-formats``)."""
        c = self.optimizer_compression
        if c is False:
            return "fp32"
        if c is True:
            return ",".join(("fp32",) + _LOSSY_FORMATS)
        return str(c)


_settings = Settings()


def _positive(name: str, value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise ValueError(f"{name}={value!r}: accepted: a positive number of GiB, or None (no cap)")
    return float(value)


def init(offload_dir: Optional[str] = None, max_vram_gb: Optional[float] = None, max_ram_gb: Optional[float] = None,
         optimizer_compression: Union[bool, str] = False, rig: Optional[str] = None) -> Settings:
    """Sets the process-wide defaults that every ``mt.Trainer`` created afterwards uses.

    Args:
        offload_dir: folder for the NVMe tier's files (created if missing). None: the rig's own
            storage folders (or none, and then the planner keeps everything in RAM).
        max_vram_gb: cap on the GPU memory the planner may use (GiB). None: the rig's.
        max_ram_gb: cap on the host RAM the planner may use (GiB). None: the rig's.
        optimizer_compression: False (fp32 Adam states), True (the planner chooses among fp32 and
            the lossy formats bf16, q8 and q4), or one format name: "bf16", "q8" or "q4".
        rig: a rig file or a name in profiles/hardware. None: $MEGATRAIN_RIG when set, else this
            machine, measured by a quick profile the first time and cached in offload_dir (or the
            Trainer's output_dir).

    Returns the new settings.
    """
    global _settings
    max_vram_gb = _positive("max_vram_gb", max_vram_gb)
    max_ram_gb = _positive("max_ram_gb", max_ram_gb)
    if not isinstance(optimizer_compression, (bool, str)) or (
            isinstance(optimizer_compression, str) and optimizer_compression not in _LOSSY_FORMATS):
        raise ValueError(f"optimizer_compression={optimizer_compression!r}: accepted: False, True, "
                         + ", ".join(f'"{f}"' for f in _LOSSY_FORMATS))
    if offload_dir is not None:
        offload_dir = os.path.abspath(os.fspath(offload_dir))
        try:
            os.makedirs(offload_dir, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"offload_dir {offload_dir!r}: cannot create it: {e.strerror}") from None
    if rig is not None:
        rig = os.fspath(rig)
    _settings = Settings(offload_dir, max_vram_gb, max_ram_gb, optimizer_compression, rig)
    return copy.copy(_settings)


def settings() -> Settings:
    """The settings ``mt.init`` made (the defaults when it was not called)."""
    return copy.copy(_settings)


def _rig_file(name_or_path: str) -> str:
    if os.path.isfile(name_or_path):
        return name_or_path
    base = os.environ.get("MEGATRAIN_PROFILES_DIR", "")
    for candidate in (os.path.join(base, "hardware", name_or_path + ".json"), os.path.join(base, "hardware", name_or_path)):
        if base and os.path.isfile(candidate):
            return candidate
    names = sorted(f[:-5] for f in os.listdir(os.path.join(base, "hardware")) if f.endswith(".json")) if base else []
    raise FileNotFoundError(f"rig {name_or_path!r}: no such file, and no rig of that name in profiles/hardware; accepted: a rig "
                            f"file or one of {', '.join(names)}")


def effective_rig(s: Settings, work_dir: str, model: str = "", seq_len: int = 0) -> str:
    """The rig file the planner gets: the named or profiled rig with mt.init's caps and offload_dir
    applied, written to ``work_dir/megatrain-rig.json`` when anything changed. A profile of this
    machine is made for the model and sequence length (its GEMM shapes, layer and head measured, as
    ``megatrain-plan profile --model --seq`` does) and cached per model and length."""
    from . import _megatrain

    rig = s.rig if s.rig is not None else os.environ.get("MEGATRAIN_RIG") or None
    if rig is not None:
        source = _rig_file(rig)
    else:
        cache_dir = s.offload_dir or work_dir
        key = hashlib.sha256(repr((os.path.abspath(model) if os.path.exists(model) else model, int(seq_len))).encode()).hexdigest()[:16]
        source = os.path.join(cache_dir, f"megatrain-rig-profile-{key}.json" if model else "megatrain-rig-profile.json")
        if not os.path.isfile(source):
            os.makedirs(cache_dir, exist_ok=True)
            errors.call(_megatrain.profile_rig, source, [s.offload_dir] if s.offload_dir else [], model, int(seq_len))
    if s.max_vram_gb is None and s.max_ram_gb is None and s.offload_dir is None:
        return os.path.abspath(source)
    with open(source, encoding="utf-8") as f:
        rig = json.load(f)
    why = {"kind": "estimate", "source": "mt.init"}
    if s.max_vram_gb is not None:
        g = rig["gpu"]["memory_bytes"]
        g["value"] = min(float(g["value"]), s.max_vram_gb * _GIB)
        g["provenance"] = dict(why, source=f"mt.init(max_vram_gb={s.max_vram_gb:g})")
    if s.max_ram_gb is not None:
        host = rig["host"]
        cap = s.max_ram_gb * _GIB
        host["ram_bytes"]["value"] = min(float(host["ram_bytes"]["value"]), cap)
        host["ram_bytes"]["provenance"] = dict(why, source=f"mt.init(max_ram_gb={s.max_ram_gb:g})")
        if "pinnable_bytes" in host:
            host["pinnable_bytes"]["value"] = min(float(host["pinnable_bytes"]["value"]), host["ram_bytes"]["value"])
    if s.offload_dir is not None:
        for drive in rig.get("storage", []):
            drive["path"] = s.offload_dir
    os.makedirs(work_dir, exist_ok=True)
    out = os.path.join(work_dir, "megatrain-rig.json")
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rig, f, indent=1)
    os.replace(tmp, out)
    return os.path.abspath(out)
