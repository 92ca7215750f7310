#!/usr/bin/env bash
# The README's main job, as far as it exists: set up, build, then show what MegaTrain knows about
# a ~100B-class model (Mistral Large 2, 123B) and the tiny test model it trains in tests.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
build_dir=${MEGATRAIN_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build_dir" -j "$(nproc)" --target megatrain-plan
plan="$build_dir/bin/megatrain-plan"

echo
echo "== megatrain-plan inspect --model mistral-large-2 --seq 4096"
"$plan" inspect --model mistral-large-2 --seq 4096
echo
echo "== megatrain-plan inspect --model llama-2-70b --seq 4096 --json"
"$plan" inspect --model llama-2-70b --seq 4096 --json
echo
echo "== megatrain-plan inspect --model tiny-llama-gqa --tensors"
"$plan" inspect --model tiny-llama-gqa --tensors
