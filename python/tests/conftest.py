"""Shared helpers of the Python package's tests (pytest, run by ctest's python.pytest and scripts/test.sh).

The package is imported from the build (PYTHONPATH=<build>/python); megatrain-exec comes from
MEGATRAIN_BIN_DIR. Every run uses the shipped 2-core CPU rig, so that the planner's choice does not
depend on a profile of whatever machine runs the tests.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import megatrain as mt

BIN_DIR = os.environ.get("MEGATRAIN_BIN_DIR", "")
RIG = "cpu-dev-2core"
MODEL = "tiny-llama-gqa"  # Llama, GQA, vocab 256, hidden 64, 2 layers


@pytest.fixture(autouse=True)
def _rig():
    mt.init(rig=RIG)
    yield
    mt.init()


def exe(name):
    path = os.path.join(BIN_DIR, name)
    if not os.path.isfile(path):
        pytest.fail(f"{path} is missing: set MEGATRAIN_BIN_DIR to the build's bin folder")
    return path


def rows(n, seed, lo=12, hi=33, vocab=256, masked=True):
    """n rows of lengths lo..hi-1 with random ids; with masked, a random prompt part labelled -100."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        m = int(rng.integers(lo, hi))
        ids = [int(t) for t in rng.integers(0, vocab, m)]
        labels = list(ids)
        if masked:
            for t in range(int(rng.integers(0, m // 2))):
                labels[t] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def manifest(step_dir):
    with open(os.path.join(step_dir, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def tensors(path):
    return mt._megatrain.read_safetensors(path)


def assert_same_tensors(a_path, b_path):
    a, b = tensors(a_path), tensors(b_path)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)), f"{k} differs"


def run_exec(*args, check=True, **kw):
    p = subprocess.run([exe("megatrain-exec"), *args], capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"megatrain-exec {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p
