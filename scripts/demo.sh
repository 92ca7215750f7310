#!/usr/bin/env bash
# The README's main job, as far as it exists: set up, build, show what MegaTrain knows about a
# ~100B-class model (Mistral Large 2, 123B) and the tiny test model, then simulate the 123B plan
# on the paper's rig and write its timeline, and train the tiny model on a text file shipped with
# Debian on the CPU backend, streamed through a bounded "device", writing its measured timeline.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
build_dir=${MEGATRAIN_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build_dir" -j "$(nproc)" --target megatrain-plan megatrain-exec
plan="$build_dir/bin/megatrain-plan"
exec_bin="$build_dir/bin/megatrain-exec"

echo
echo "== megatrain-plan inspect --model mistral-large-2 --seq 4096"
"$plan" inspect --model mistral-large-2 --seq 4096
echo
echo "== megatrain-plan inspect --model llama-2-70b --seq 4096 --json"
"$plan" inspect --model llama-2-70b --seq 4096 --json
echo
echo "== megatrain-plan inspect --model tiny-llama-gqa --tensors"
"$plan" inspect --model tiny-llama-gqa --tensors
echo
echo "== megatrain-plan simulate profiles/plans/mistral-large-2-h200.json --trace out/mistral-large-2-h200.mtrace"
mkdir -p out
"$plan" simulate profiles/plans/mistral-large-2-h200.json --trace out/mistral-large-2-h200.mtrace
echo
echo "== megatrain-plan simulate profiles/plans/tiny-cpu.json --json"
"$plan" simulate profiles/plans/tiny-cpu.json --json
echo
echo "== megatrain-exec profiles/plans/tiny-cpu.json --data /usr/share/common-licenses/GPL-3 --trace out/tiny-cpu.mtrace"
"$exec_bin" profiles/plans/tiny-cpu.json --data /usr/share/common-licenses/GPL-3 --trace out/tiny-cpu.mtrace
