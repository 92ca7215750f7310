#!/usr/bin/env bash
# Run on the GPU machine over a carried build (build-gpu/, preset gpu-bundle): checks that the
# CUDA runtime sees the card and that the GPU tests pass, then prints a short table last.
# Nothing is installed there; everything comes from the carried build.
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build-gpu}
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv \
  | tee "$out/nvidia-smi.csv"
status=0
if [ -x "$build_dir/tests/megatrain_kernels_tests" ]; then
  "$build_dir/tests/megatrain_kernels_tests" --gtest_brief=0 | tee "$out/kernels-tests.txt" || status=1
else
  echo "missing $build_dir/tests/megatrain_kernels_tests: build with 'cmake --preset gpu-bundle && cmake --build build-gpu'"
  status=1
fi
echo
echo "| check | result |"
echo "|---|---|"
echo "| kernels tests | $([ $status -eq 0 ] && echo pass || echo FAIL) |"
exit $status
