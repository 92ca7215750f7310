#!/usr/bin/env bash
# The Python package installed as users install it (docs/python.md): `pip install --no-build-isolation .`
# into a fresh venv of the interpreter the build's module is for, building offline in the CMake
# build folder given (so nothing is compiled twice), then `import megatrain` and a 2-step training
# run from outside the source tree, with nothing of the source or build on the path.
# Usage: scripts/python-install-check.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(pwd)
build=$(cd "${1:-build}" && pwd)
work=$(mktemp -d /tmp/megatrain-venv.XXXXXX)
trap 'rm -rf "$work"' EXIT
# The interpreter the build's extension module was made for: the one the project's venv
# (scripts/python-env.sh) was created from. The fresh venv gets the package's one dependency, NumPy
# (pinned as in requirements.txt), then the package itself, built offline in the build folder.
base=$("$build/venv/bin/python" -c 'import sys; print(sys._base_executable)')
"$base" -m venv "$work/venv"
numpy=$(grep -m1 -i '^numpy==' "$src/requirements.txt" || echo numpy)
{ "$work/venv/bin/pip" install -q --upgrade setuptools wheel "$numpy" &&
  MEGATRAIN_BUILD_DIR="$build" "$work/venv/bin/pip" install --no-build-isolation --no-index --no-deps -q "$src"; } \
  > "$work/pip.log" 2>&1 || { tail -40 "$work/pip.log"; echo "python-install-check: pip install failed" >&2; exit 1; }
rm -rf "$src/python/megatrain.egg-info" "$src/build/lib" "$src/build/bdist.linux-x86_64" 2>/dev/null || true
cd "$work"
env -u PYTHONPATH -u MEGATRAIN_PROFILES_DIR "$work/venv/bin/python" - "$work" <<'PY'
import os, sys, time
t0 = time.perf_counter()
import megatrain as mt
import_s = time.perf_counter() - t0
where = os.path.dirname(mt.__file__)
assert where.startswith(sys.argv[1]), f"megatrain imported from {where}, not from the venv"
mt.init(rig="cpu-dev-2core")
rows = [[(7 * i + 3 * k) % 256 for k in range(20)] for i in range(8)]
args = mt.TrainingArguments(output_dir=os.path.join(sys.argv[1], "out"), per_device_train_batch_size=2,
                            gradient_accumulation_steps=2, max_steps=2, logging_steps=1, learning_rate=1e-3)
out = mt.Trainer(model="tiny-llama-gqa", args=args, train_dataset=rows).train()
assert out.global_step == 2 and out.training_loss > 0, out
print(f"python-install-check: megatrain {mt.__version__} installed in a fresh venv ({where}); import took "
      f"{import_s * 1000:.0f} ms; 2 steps trained, loss {out.training_loss:.4f}")
PY
