#!/usr/bin/env python3
"""--init from a gpt-oss folder whose experts are stored in MXFP4, against an independent numpy
dequantiser: runs Mxfp4Init.* of megatrain_executor_tests, which has tests/python/mxfp4_checkpoint.py
write the folder (single file and sharded) and the expected fp32 values, then loads it with
load_weights and compares bit for bit. A missing numpy is a failure naming it.
Usage: test_mxfp4_init.py BUILD_DIR SOURCE_DIR."""
import os
import subprocess
import sys

try:
    import numpy  # noqa: F401
except ImportError as e:
    print(f"FAIL: numpy is missing for {sys.executable} (scripts/python-env.sh installs requirements.txt)")
    sys.exit(1)

binary = os.path.join(sys.argv[1], "tests", "megatrain_executor_tests")
if not os.path.exists(binary):
    print(f"FAIL: {binary} is not built (the megatrain_executor target is absent)")
    sys.exit(1)

r = subprocess.run([binary, "--gtest_filter=Mxfp4Init.*:Mxfp4.*", "--gtest_brief=0"])
sys.exit(0 if r.returncode == 0 else 1)
