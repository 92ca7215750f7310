#!/usr/bin/env bash
# megatrain-data encode and decode as users and scripts call them, on a small byte-level BPE
# tokenizer written here (the real tokenizers are checked in tests/text): ids on stdout, --json,
# special tokens only when asked, and errors that name the file, the JSON path or the id.
set -uo pipefail
data=$(dirname "$1")/megatrain-data
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }

mkdir -p "$tmp/model"
/usr/bin/python3 - "$tmp/model/tokenizer.json" <<'PY'
import json, sys
vocab = {t: i for i, t in enumerate(["a", "b", "c", "\u0120", "ab", "bc", "abc", "\u0120a", "x"])}
json.dump({"model": {"type": "BPE", "vocab": vocab, "merges": ["b c", "a b", "ab c", "\u0120 a"]},
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
           "decoder": {"type": "ByteLevel"},
           "added_tokens": [{"id": 9, "content": "<|end|>", "special": True}],
           "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|end|>"}}, {"Sequence": {"id": "A"}}],
                              "special_tokens": {"<|end|>": {"id": "<|end|>", "ids": [9]}}}}, open(sys.argv[1], "w"))
PY

out=$("$data" encode --tokenizer "$tmp/model" --text 'ab<|end|>c' 2>"$tmp/err")
check "encode: ids separated by spaces (got '$out')" "[ '$out' = '4 9 2' ] && [ ! -s $tmp/err ]"
out=$("$data" encode --tokenizer "$tmp/model/tokenizer.json" --text ' a b' --json)
check "encode --json (got '$out')" "[ '$out' = '{\"ids\": [7, 3, 1]}' ]"
out=$("$data" encode --tokenizer "$tmp/model" --text 'c' --add-special-tokens)
check "encode --add-special-tokens (got '$out')" "[ '$out' = '9 2' ]"
printf ' a' >"$tmp/text"
out=$("$data" encode --tokenizer "$tmp/model" --text-file "$tmp/text")
check "encode --text-file: the file's bytes (got '$out')" "[ '$out' = '7' ]"
out=$("$data" decode --tokenizer "$tmp/model" --ids 7 3 1 9 2)
check "decode (got '$out')" "[ '$out' = ' a b<|end|>c' ]"
out=$("$data" decode --tokenizer "$tmp/model" --ids 7 9 2 --skip-special-tokens --json)
check "decode --skip-special-tokens --json (got '$out')" "[ '$out' = '{\"text\": \" ac\"}' ]"

"$data" decode --tokenizer "$tmp/model" --ids 99 >"$tmp/out" 2>"$tmp/err"
check "decode of an unknown id: exit 1, the id named" "[ $? -eq 1 ] && grep -q 'id 99 is not in the vocabulary' $tmp/err"
"$data" encode --tokenizer "$tmp/nowhere" --text x >"$tmp/out" 2>"$tmp/err"
check "a missing tokenizer: exit 1, the path named" "[ $? -eq 1 ] && grep -q \"$tmp/nowhere: cannot be read\" $tmp/err"
sed 's/"ByteLevel", "add_prefix_space"/"Digits", "add_prefix_space"/' "$tmp/model/tokenizer.json" >"$tmp/bad.json"
"$data" encode --tokenizer "$tmp/bad.json" --text x >"$tmp/out" 2>"$tmp/err"
check "an unsupported pre-tokenizer: exit 1, its JSON path named" "[ $? -eq 1 ] && grep -q \"bad.json: pre_tokenizer: the pre-tokenizer 'Digits' is not supported\" $tmp/err"
"$data" encode --tokenizer "$tmp/model" >"$tmp/out" 2>"$tmp/err"
check "encode without a text: exit 1" "[ $? -eq 1 ] && grep -q 'give --text or --text-file' $tmp/err"
"$data" decode --tokenizer "$tmp/model" --ids -3 >"$tmp/out" 2>"$tmp/err"
check "a negative id: exit 1" "[ $? -eq 1 ]"
echo "$fails failed"
[ "$fails" -eq 0 ]
