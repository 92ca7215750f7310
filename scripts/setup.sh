#!/usr/bin/env bash
# Installs the Debian packages MegaTrain needs to build, test and benchmark.
# Safe to run again: it asks dpkg what is missing and installs only that; with nothing missing it
# says so and changes nothing. Runs as root, or through sudo.
set -euo pipefail

# See ../shared/design/ENVIRONMENT.md for why each is here. The Python side (PyTorch, transformers,
# tokenizers, pytest, pybind11) is not Debian's: scripts/python-env.sh installs requirements.txt
# from PyPI into the build folder's venv.
packages=(
  build-essential cmake ninja-build pkg-config
  libsqlite3-dev sqlite3 nlohmann-json3-dev libcli11-dev libeigen3-dev
  liburing-dev libzstd-dev libgtest-dev libgmock-dev libbenchmark-dev
  qt6-base-dev qt6-charts-dev libqt6opengl6-dev
  fio libopenblas0-openmp
  libpcre2-dev libutf8proc-dev
  python3-dev python3-venv python3-pip python3-setuptools
  openmpi-bin libopenmpi-dev
  clang libclang-rt-dev
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

# cuBLAS and NCCL into the CUDA toolkit where it came without them (scripts/cuda-libs.sh).
"$(dirname "$0")/cuda-libs.sh"

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "setup: all ${#packages[@]} packages already installed; nothing to do."
  exit 0
fi

if [[ $(id -u) -eq 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "setup: need root or sudo to install: ${missing[*]}" >&2
  exit 1
fi

echo "setup: installing ${#missing[@]} package(s): ${missing[*]}"
log=$(mktemp /tmp/megatrain-setup.XXXXXX.log)
export DEBIAN_FRONTEND=noninteractive
if ! { "${as_root[@]}" apt-get update -q && \
       "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "setup: apt-get failed; the full log is $log" >&2
  exit 1
fi
rm -f "$log"
echo "setup: installed ${missing[*]}"
