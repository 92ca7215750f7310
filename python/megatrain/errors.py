"""The exceptions the package raises, and how a C++ Status becomes one of them.

Every failure of the C++ libraries arrives as ``_megatrain.StatusError(code, message, phase)`` and
leaves the package as a standard Python exception that keeps the command-line message:

- ``FileNotFoundError``: a path, model name or rig name that does not exist (``not_found``);
- ``PlanError`` (a ``ValueError``): a model or batch that does not fit the rig, naming the tier and
  the shortfall in bytes (``resource_exhausted`` while planning or building the training state);
- ``CheckpointError``: a checkpoint that does not load (anything that fails while resuming);
- ``ValueError``: a value that is not accepted, a file that does not parse, an unsupported model;
- ``OSError``: what the operating system refused (a full disk, a failed write);
- ``RuntimeError``: hardware that is not there, or a broken invariant inside MegaTrain.
"""

from __future__ import annotations

import errno as _errno

__all__ = ["PlanError", "CheckpointError"]


class PlanError(ValueError):
    """The model, batch shape and rig have no plan that fits: the message names each tier short of
    bytes and by how much (the planner's per-tier explanation)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: missing, corrupt (the file and the check that failed
    are named), of another model or another run's plan."""


_VALUE_CODES = {"invalid_argument", "parse_error", "unsupported", "corrupt"}


def from_status(err: BaseException) -> BaseException:
    """The Python exception for a ``_megatrain.StatusError``; other exceptions are returned as they are."""
    from . import _megatrain

    if not isinstance(err, _megatrain.StatusError):
        return err
    code, message, phase = (list(err.args) + ["", "", ""])[:3]
    if phase == "resume" and code != "resource_exhausted":
        return CheckpointError(message)
    if code == "not_found":
        return FileNotFoundError(_errno.ENOENT, message)
    if code == "resource_exhausted" and phase in ("", "plan", "state"):
        return PlanError(message)
    if code in _VALUE_CODES:
        return ValueError(message)
    if code in ("io_error", "resource_exhausted"):
        return OSError(message)
    return RuntimeError(message)


def call(fn, *args, **kwargs):
    """Calls a ``_megatrain`` function, raising its StatusError as the matching Python exception."""
    from . import _megatrain

    try:
        return fn(*args, **kwargs)
    except _megatrain.StatusError as e:
        raise from_status(e) from None
