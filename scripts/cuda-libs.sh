#!/usr/bin/env bash
# cuBLAS and NCCL for the CUDA toolkit, where the machine's toolkit came without them (seen on
# 2026-12-07: nvcc, cudart and NVTX at /usr/local/cuda-13.0, but no cublas_v2.h and no nccl.h).
# The CUDA backend needs cuBLAS to compile, and parallel.collective nccl needs nccl.h; NVIDIA ships
# both on PyPI as wheels (nvidia-cublas, nvidia-nccl-cu13), which this script downloads, pinned, and
# copies into the toolkit (include/ and lib64/, with the unversioned .so links a linker needs), so
# that CMake's FindCUDAToolkit finds them where it looks. Run by scripts/setup.sh; safe to run again
# (does nothing when the headers are there). Without nvcc, or for a toolkit other than CUDA 13, it
# says so and changes nothing: CMake then builds without CUDA and says why.
set -euo pipefail
nvcc=$(command -v nvcc || true)
if [ -z "$nvcc" ]; then echo "cuda-libs: no nvcc here; nothing to do"; exit 0; fi
# The toolkit nvcc really runs from (/usr/local/bin/nvcc may be a wrapper script).
top=$("$nvcc" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
cuda=$(cd "${top:-$(dirname "$(readlink -f "$nvcc")")/..}" && pwd)
release=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1/p')
need=()
[ -f "$cuda/include/cublas_v2.h" ] || need+=("nvidia-cublas==13.0.2.14")
[ -f "$cuda/include/nccl.h" ] || need+=("nvidia-nccl-cu13==2.32.6")
if [ ${#need[@]} -eq 0 ]; then echo "cuda-libs: cuBLAS and NCCL headers present in $cuda"; exit 0; fi
if [ "$release" != 13 ]; then
  echo "cuda-libs: $cuda (CUDA $release) lacks ${need[*]%%=*}; only CUDA 13's wheels are pinned here, so CMake will build without what is missing"
  exit 0
fi
py=$(command -v python3)
work=$(mktemp -d /tmp/megatrain-cuda-libs.XXXXXX)
trap 'rm -rf "$work"' EXIT
if ! "$py" -m pip download -q --no-deps -d "$work/wheels" "${need[@]}" >"$work/pip.log" 2>&1; then
  echo "cuda-libs: could not download ${need[*]} from PyPI ($(grep -m1 -E 'ERROR' "$work/pip.log" || tail -1 "$work/pip.log")); CMake will build without them"
  exit 0
fi
mkdir -p "$cuda/lib64"
for whl in "$work"/wheels/*.whl; do
  "$py" -m zipfile -e "$whl" "$work/x"
done
for inc in "$work"/x/nvidia/*/include; do cp -r "$inc"/. "$cuda/include/"; done
for lib in "$work"/x/nvidia/*/lib/lib*.so.*; do
  name=$(basename "$lib")
  install -m 0755 "$lib" "$cuda/lib64/$name"
  ln -sf "$name" "$cuda/lib64/${name%%.so.*}.so"
done
echo "cuda-libs: installed ${need[*]} into $cuda (include/, lib64/)"
