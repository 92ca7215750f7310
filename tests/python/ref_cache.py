"""The PyTorch side of a reference comparison, cached across the reruns of one test run.

scripts/test.sh runs the numerically sensitive tests several times (each AdamW path, each
instruction-set build of our kernels: docs/testing.md). Our side changes between those runs; the
PyTorch side does not. With MEGATRAIN_TORCH_CACHE set to a folder, a training run of
torch_train_ref.py or torch_moe_ref.py is stored there under a key that covers everything it reads:
the scripts' own source, the case's files (config, spec, initial weights, tokens), the slip, the
dtype, PyTorch's version, build configuration and thread count. A rerun with the same key loads
the stored result instead of training again; anything else trains. Without the variable nothing is
cached.
"""
import hashlib
import os

import torch

CASE_FILES = ("config.json", "spec.json", "init.safetensors", "tokens.u32", "batches.i32")


def cached(case_dir, scripts, what, train):
    """train() once per key: `what` names the run (dtype, slip, ...), `scripts` the source files."""
    folder = os.environ.get("MEGATRAIN_TORCH_CACHE")
    if not folder:
        return train()
    h = hashlib.sha256()
    for path in list(scripts) + [__file__] + [os.path.join(case_dir, n) for n in CASE_FILES]:
        if not os.path.exists(path):
            continue
        data = open(path, "rb").read()
        h.update(os.path.basename(path).encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    h.update(repr((what, torch.__version__, torch.__config__.show(), torch.get_num_threads())).encode())
    path = os.path.join(folder, h.hexdigest() + ".pt")
    if os.path.exists(path):
        try:
            return torch.load(path)
        except Exception:  # a damaged entry is trained again and replaced
            pass
    result = train()
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(result, tmp)
    os.replace(tmp, path)
    return result
