#!/usr/bin/env python3
"""Every CPU op (kernels/cpu/) against PyTorch, forward and backward, in float64 and float32.
Runs the C++ test KernelsVsTorch.* of megatrain_kernels_cpu_tests, which writes each op's inputs and
our outputs and gradients to a temporary folder and has tests/python/kernels_ref.py (the PyTorch
reference, after the HF modeling code) recompute and compare them. A missing torch or numpy is a
failure naming it.
Usage: test_kernels_vs_torch.py BUILD_DIR SOURCE_DIR."""
import os
import subprocess
import sys

try:
    import torch  # noqa: F401
    import numpy  # noqa: F401
except ImportError as e:
    print(f"FAIL: {e.name} is missing for {sys.executable} (scripts/python-env.sh installs requirements.txt)")
    sys.exit(1)

build_dir = sys.argv[1]
binary = os.path.join(build_dir, "tests", "megatrain_kernels_cpu_tests")
if not os.path.exists(binary):
    print(f"FAIL: {binary} is not built (the megatrain_kernels_cpu target is absent)")
    sys.exit(1)

r = subprocess.run([binary, "--gtest_filter=KernelsVsTorch.*", "--gtest_brief=0"])
sys.exit(0 if r.returncode == 0 else 1)
