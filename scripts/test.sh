#!/usr/bin/env bash
# The README's test command: install dependencies, configure, build, and run every test that can
# run on this machine (GPU tests skip with a message when there is no GPU). Non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
build_dir=${MEGATRAIN_BUILD_DIR:-build}
jobs=${MEGATRAIN_JOBS:-$(nproc)}

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEGATRAIN_TESTS=ON
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900


# ctest does not show why a test skipped; say it once for the GPU tests.
if [ -x "$build_dir/tests/megatrain_kernels_tests" ]; then
  reason=$("$build_dir/tests/megatrain_kernels_tests" --gtest_filter='CudaDevice.ListsDevicesOrSaysWhyNot' 2>&1 \
           | grep -m1 -o 'no GPU here: .*' || true)
  [ -n "$reason" ] && echo "GPU tests skipped: ${reason#no GPU here: }"
fi
exit 0
