#!/usr/bin/env bash
# The one Python environment of the project (issue 46): a virtual environment at <BUILD_DIR>/venv,
# made from the python3 on the PATH, with requirements.txt installed. CMake builds the extension
# module for its interpreter, and every Python test, reference, example and bench runs in it.
# Safe to run again: it does nothing while the venv holds what requirements.txt asks for (a stamp
# with the file's hash). When PyPI (or this machine's wheel mirror) cannot be reached it says so in
# one line and exits 0: the venv is still made, and every test that needs a missing package fails
# naming it (nothing that needs one skips).
# Usage: scripts/python-env.sh [BUILD_DIR]   (default: build); prints nothing else on success but a line.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
mkdir -p "$build"
venv="$(cd "$build" && pwd)/venv"
req="$(pwd)/requirements.txt"
want=$(sha256sum "$req" | cut -c1-16)
py=$(command -v python3 || true)
[ -n "$py" ] || { echo "python-env: no python3 on the PATH; install Python 3 (3.11 has PyTorch 2.13's CPU wheel)" >&2; exit 1; }
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.megatrain-requirements" 2>/dev/null)" = "$want" ]; then
  echo "python-env: $venv holds requirements.txt ($("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])'))"
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv" || { echo "python-env: '$py -m venv' failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
log="$venv/pip-install.log"
if "$venv/bin/python" -m pip install -r "$req" >"$log" 2>&1; then
  echo "$want" >"$venv/.megatrain-requirements"
  echo "python-env: $venv ready: $("$venv/bin/python" -c 'import sys, torch, transformers
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")')"
else
  rm -f "$venv/.megatrain-requirements"
  echo "python-env: could not install requirements.txt into $venv (PyPI unreachable?): $(grep -m1 -E 'ERROR|error:' "$log" || tail -1 "$log"); the tests that need a missing package will fail naming it; full log: $log"
fi
