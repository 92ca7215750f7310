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
# prepare: alpaca records into padded rows of seq 128 (the tiny plan's), the answers counted; inspect
# marks what does not count; megatrain-exec trains on the file; a damaged file is refused by name.
cat >"$tmp/sft.jsonl" <<'JL'
{"instruction": "ab", "input": "c", "output": "abc abc"}
{"instruction": "ba", "output": "cab"}

{"instruction": "a b c", "output": " a"}
JL
printf '{"instruction": "ab"}\n' >"$tmp/bad.jsonl"
python3 - "$tmp/model" <<'PY'
import json, sys
json.dump({"eos_token": "<|end|>"}, open(sys.argv[1] + "/tokenizer_config.json", "w"))
PY
"$data" prepare --tokenizer "$tmp/model" --input "$tmp/sft.jsonl" --seq 128 --pad -o "$tmp/sft.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare: exit 0 and a summary" "[ $? -eq 0 ] && grep -q 'documents 3 (alpaca format)' $tmp/out && grep -q 'train on assistant' $tmp/out"
"$data" inspect "$tmp/sft.mtseq" --rows 1 >"$tmp/out" 2>&1
check "inspect: counts and a row with the prompt marked" "grep -q '3 rows of 129 tokens (pad)' $tmp/out && grep -q 'counted targets' $tmp/out && grep -q \"\$(printf '\\u27e6')\" $tmp/out"
"$data" prepare --tokenizer "$tmp/model" --input "$tmp/sft.jsonl" --seq 16 --pack-neat -o "$tmp/neat.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare --pack-neat: the header says neat, and the summary says each document attends only to itself" \
  "[ $? -eq 0 ] && grep -q 'each document attending only to itself' $tmp/out && \"$data\" inspect $tmp/neat.mtseq --rows 0 | grep -q 'neat'"
"$data" prepare --tokenizer "$tmp/model" --input "$tmp/sft.jsonl" --seq 16 --pack-neat --pad -o "$tmp/x.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare --pack-neat --pad: refused (one packing)" "[ $? -ne 0 ] && [ ! -e $tmp/x.mtseq ]"
"$data" prepare --tokenizer "$tmp/model" --input "$tmp/bad.jsonl" --format alpaca --seq 128 -o "$tmp/x.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare of a record without its output: exit 1, file:line and field named, nothing written" \
  "[ $? -eq 1 ] && grep -q \"bad.jsonl:1: no 'output' field\" $tmp/err && [ ! -e $tmp/x.mtseq ]"
# Conversations: a chat template in tokenizer_config.json (a user turn is "b" + content + <|end|>,
# an assistant turn "a" + content + <|end|>; the generation prompt is "a"); messages and sharegpt
# records give the same rows, and only the assistant turns count.
mkdir -p "$tmp/chat"
cp "$tmp/model/tokenizer.json" "$tmp/chat/"
python3 - "$tmp/chat" <<'PY'
import json, sys
t = "{% for m in messages %}{% if m.role == 'user' %}b{% else %}a{% endif %}{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}a{% endif %}"
json.dump({"eos_token": "<|end|>", "chat_template": t}, open(sys.argv[1] + "/tokenizer_config.json", "w"))
PY
printf '%s
' '{"messages": [{"role": "user", "content": "cc"}, {"role": "assistant", "content": "ab"}]}' >"$tmp/chat.jsonl"
printf '%s
' '{"conversations": [{"from": "human", "value": "cc"}, {"from": "gpt", "value": "ab"}]}' >"$tmp/share.jsonl"
"$data" prepare --tokenizer "$tmp/chat" --input "$tmp/chat.jsonl" --seq 16 --pad -o "$tmp/chat.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare messages: the assistant turn counts (ab and <|end|>: 2 targets)" \
  "[ $? -eq 0 ] && grep -q 'documents 1 (messages format)' $tmp/out && grep -q 'counted targets 2,' $tmp/out && grep -q 'train on assistant' $tmp/out"
"$data" inspect "$tmp/chat.mtseq" --rows 1 >"$tmp/out" 2>&1
check "inspect marks the user turn and the assistant's prompt" "grep -q \"\$(printf '\u27e6')bcc<|end|>a\$(printf '\u27e7')ab<|end|>\" $tmp/out"
"$data" prepare --tokenizer "$tmp/chat" --input "$tmp/share.jsonl" --seq 16 --pad -o "$tmp/share.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare sharegpt: the same rows as messages" "[ $? -eq 0 ] && grep -q '(sharegpt format)' $tmp/out && cmp -s <(tail -c +200 $tmp/chat.mtseq | od -An -tx1 | tail -3) <(tail -c +200 $tmp/share.mtseq | od -An -tx1 | tail -3)"
"$data" prepare --tokenizer "$tmp/chat" --input "$tmp/chat.jsonl" --seq 16 --train-on all -o "$tmp/all.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare messages --train-on all: every target counts (6 tokens: bc c <|end|> a ab <|end|>)" "[ $? -eq 0 ] && grep -q 'counted targets 5,' $tmp/out"
printf '%s
' '{"conversations": [{"from": "human", "value": "cc"}, {"from": "robot", "value": "ab"}]}' >"$tmp/bad-share.jsonl"
"$data" prepare --tokenizer "$tmp/chat" --input "$tmp/bad-share.jsonl" --seq 16 -o "$tmp/x.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare sharegpt with an unknown speaker: exit 1, file:line and the accepted names" \
  "[ $? -eq 1 ] && grep -q \"bad-share.jsonl:1: conversations\[1\]: 'from' is 'robot'; accepted: human\" $tmp/err && [ ! -e $tmp/x.mtseq ]"
"$data" prepare --tokenizer "$tmp/model" --input "$tmp/chat.jsonl" --seq 16 -o "$tmp/x.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare messages with a tokenizer that has no chat template: exit 1, named" "[ $? -eq 1 ] && grep -q 'no chat template' $tmp/err"
printf '{%% for m in messages %%}{{ m.content }}<|end|>{%% endfor %%}{%% if add_generation_prompt %%}x{%% endif %%}' >"$tmp/other.jinja"
"$data" prepare --tokenizer "$tmp/model" --input "$tmp/chat.jsonl" --seq 16 --chat-template "$tmp/other.jinja" -o "$tmp/x.mtseq" >"$tmp/out" 2>"$tmp/err"
check "prepare --chat-template FILE: that template (whose generation prompt x is not where the turn starts)" "[ $? -eq 1 ] && grep -q 'assistant message 2 of 2: the conversation before it' $tmp/err"
exec_bin=$(dirname "$1")/megatrain-exec
if [ -x "$exec_bin" ]; then
  "$exec_bin" "$2/profiles/plans/tiny-cpu.json" --data "$tmp/sft.mtseq" --steps 2 >"$tmp/out" 2>&1
  check "megatrain-exec trains on a prepared dataset" "[ $? -eq 0 ] && grep -Eq 'step +2/2  loss [0-9]' $tmp/out"
  cp "$tmp/sft.mtseq" "$tmp/damaged.mtseq"
  printf '\x07' | dd of="$tmp/damaged.mtseq" bs=1 seek=5000 conv=notrunc 2>/dev/null
  "$exec_bin" "$2/profiles/plans/tiny-cpu.json" --data "$tmp/damaged.mtseq" --steps 1 >"$tmp/out" 2>&1
  check "megatrain-exec refuses a damaged prepared dataset, naming it" "[ $? -ne 0 ] && grep -q 'damaged.mtseq: the checksum of its rows' $tmp/out"
  # Rows packed "neat": trained, with a note that the plan (made for whole rows) counts the
  # attention over whole rows; megatrain-plan plan --data writes the documents' length into a plan
  # (which then trains without the note), and a length past the rows is refused.
  "$data" prepare --tokenizer "$tmp/model" --input "$tmp/sft.jsonl" --seq 128 --pack-neat -o "$tmp/neat128.mtseq" >/dev/null 2>&1
  "$data" inspect "$tmp/neat128.mtseq" >"$tmp/out" 2>&1
  check "inspect of neat rows: the documents' weighted length" "grep -Eq 'documents attend only to themselves: [0-9.]+ tokens each' $tmp/out"
  "$exec_bin" "$2/profiles/plans/tiny-cpu.json" --data "$tmp/neat128.mtseq" --steps 2 >"$tmp/out" 2>&1
  check "megatrain-exec trains neat rows, noting the plan was made for whole rows" \
    "[ $? -eq 0 ] && grep -Eq 'step +2/2  loss [0-9]' $tmp/out && grep -q 'but the plan was made for whole-row contexts' $tmp/out"
  plan_bin=$(dirname "$1")/megatrain-plan
  "$plan_bin" plan --model tiny-llama-gqa --rig cpu-dev-2core --data "$tmp/neat128.mtseq" --tokens-per-step 512 --top 0 \
    -o "$tmp/neat-plan.json" >"$tmp/out" 2>&1
  want=$(python3 -c "import json,sys; h=open(sys.argv[1],'rb').read(4096); n=int.from_bytes(h[8:16],'little'); print(json.loads(h[16:16+n])['document_tokens'])" "$tmp/neat128.mtseq")
  check "megatrain-plan plan --data: the plan holds the file's seq_len and document_tokens ($want)" \
    "[ $? -eq 0 ] && python3 -c \"import json,sys; t=json.load(open('$tmp/neat-plan.json'))['training']; sys.exit(not (t['seq_len'] == 128 and abs(t['document_tokens'] - $want) < 1e-9 and 1 <= $want < 128))\""
  "$exec_bin" "$tmp/neat-plan.json" --data "$tmp/neat128.mtseq" --steps 1 >"$tmp/out" 2>&1
  check "a plan made for the neat rows trains them without the note" "[ $? -eq 0 ] && ! grep -q 'the plan was made for' $tmp/out"
  "$plan_bin" plan --model tiny-llama-gqa --rig cpu-dev-2core --data "$tmp/neat128.mtseq" --seq 64 >"$tmp/out" 2>&1
  check "megatrain-plan plan --data with another --seq: refused with both numbers" "[ $? -eq 1 ] && grep -q -- '--seq 64, but .*rows of 128 tokens' $tmp/out"
  "$plan_bin" plan --model tiny-llama-gqa --rig cpu-dev-2core --seq 128 --document-tokens 200 >"$tmp/out" 2>&1
  check "megatrain-plan plan --document-tokens past the rows: refused, the range named" "[ $? -ne 0 ] && grep -q 'accepted: 0 (one context per row) or 1 .. 128' $tmp/out"
  "$data" prepare --tokenizer "$tmp/model" --input "$tmp/sft.jsonl" --seq 64 -o "$tmp/s64.mtseq" >/dev/null 2>&1
  "$exec_bin" "$2/profiles/plans/tiny-cpu.json" --data "$tmp/s64.mtseq" --steps 1 >"$tmp/out" 2>&1
  check "a prepared dataset of another seq_len: refused with both numbers" "[ $? -ne 0 ] && grep -q 'seq_len 64, the plan.s training.seq_len is 128' $tmp/out"
  # --data FILE.jsonl --tokenizer DIR: prepared on the fly into the checkpoint folder's cache, and
  # reused by the next run while nothing changed.
  "$exec_bin" "$2/profiles/plans/tiny-cpu.json" --data "$tmp/sft.jsonl" --tokenizer "$tmp/model" --checkpoint-dir "$tmp/ck" \
    --steps 1 >"$tmp/out" 2>&1
  check "on the fly: prepared into <checkpoint-dir>/data-cache and trained" \
    "[ $? -eq 0 ] && grep -q 'prepared with' $tmp/out && ls $tmp/ck/data-cache/sft-*.mtseq >/dev/null && grep -Eq 'step +1/1' $tmp/out"
  # Without --checkpoint-dir the cache is the user's ($XDG_CACHE_HOME/megatrain/data-cache here).
  # issue 49: budgets on a record and on a file read whole (MEGATRAIN_LIMITS)
  MEGATRAIN_LIMITS=record_bytes=20 "$data" prepare --tokenizer "$tmp/model" --input "$tmp/sft.jsonl" --seq 64 -o "$tmp/rb.mtseq" >"$tmp/out" 2>&1
  check "prepare: a JSON Lines record past record_bytes is refused naming the file, the line and the limit" \
    "[ $? -ne 0 ] && grep -q 'sft.jsonl:1: a record of [0-9]* bytes: more than 20 bytes (limit record_bytes' $tmp/out && [ ! -e $tmp/rb.mtseq ]"
  # the limit just above the tokenizer's files, the dataset past it
  lim=$(( $(stat -c %s "$tmp/model/tokenizer.json") + $(stat -c %s "$tmp/model/tokenizer_config.json" 2>/dev/null || echo 0) + 1 ))
  python3 -c "import json, sys; json.dump([{'text': 'a JSON dataset, parsed whole'}] * (int(sys.argv[1]) // 20), open(sys.argv[2], 'w'))" "$lim" "$tmp/whole.json"
  MEGATRAIN_LIMITS=file_bytes=$lim "$data" prepare --tokenizer "$tmp/model" --input "$tmp/whole.json" --seq 64 -o "$tmp/wj.mtseq" >"$tmp/out" 2>&1
  check "prepare: a .json dataset past file_bytes is refused before it is read" \
    "[ $? -ne 0 ] && grep -q \"the JSON dataset '$tmp/whole.json' holds [0-9]* bytes, read whole and parsed: more than $lim bytes (limit file_bytes\" $tmp/out && [ ! -e $tmp/wj.mtseq ]"
  MEGATRAIN_LIMITS=file_bytes=100 "$data" encode --tokenizer "$tmp/model" --text a >"$tmp/out" 2>&1
  check "a tokenizer.json past file_bytes is refused before it is read" \
    "[ $? -ne 0 ] && grep -q 'tokenizer.json .* bytes, read whole and parsed: more than 100 bytes (limit file_bytes' $tmp/out"
  # issue 49: a FIFO for every input path (it would block the read, or be skipped as absent)
  mkfifo "$tmp/tpl.fifo"
  timeout 20 "$data" prepare --tokenizer "$tmp/model" --input "$tmp/sft.jsonl" --seq 64 --chat-template "$tmp/tpl.fifo" -o "$tmp/ff.mtseq" >"$tmp/out" 2>&1
  check "prepare --chat-template FIFO: refused, no hang" "[ $? -eq 1 ] && grep -q 'not a regular file' $tmp/out"
  mkdir -p "$tmp/fifo-model" && cp "$tmp/model/tokenizer.json" "$tmp/fifo-model/" && mkfifo "$tmp/fifo-model/tokenizer_config.json"
  timeout 20 "$data" encode --tokenizer "$tmp/fifo-model" --text a >"$tmp/out" 2>&1
  check "a tokenizer_config.json that is a FIFO: refused, not read as absent (its BOS and EOS would be lost)" \
    "[ $? -eq 1 ] && grep -q 'tokenizer_config.json: not a regular file' $tmp/out"
  srcdir=$2
  onfly() { XDG_CACHE_HOME="$tmp/xdg" "$exec_bin" "$srcdir/profiles/plans/tiny-cpu.json" --data "$tmp/sft.jsonl" --tokenizer "$tmp/model" --steps 1 "$@"; }
  cache=$tmp/xdg/megatrain/data-cache
  onfly >"$tmp/out" 2>&1
  check "on the fly without a checkpoint folder: the user's cache folder, mode 0700" \
    "[ $? -eq 0 ] && grep -q 'prepared with' $tmp/out && ls $cache/sft-*.mtseq >/dev/null && [ \$(stat -c %a $cache) = 700 ]"
  onfly >"$tmp/out" 2>&1
  check "on the fly: the second run reuses the prepared file, verified" "[ $? -eq 0 ] && grep -q 'prepared before (.*verified)' $tmp/out"
  # issue 49: a file put in the cache under the right name is not trained on.
  cached=$(ls $cache/sft-*.mtseq)
  cp "$tmp/neat128.mtseq" "$cached"
  onfly >"$tmp/out" 2>&1
  check "on the fly: a valid prepared file of other inputs put under the cached name is refused and prepared again" \
    "[ $? -eq 0 ] && grep -q 'does not carry the key of these inputs' $tmp/out && grep -q 'prepared with' $tmp/out"
  printf 'junk' >>"$cached"
  onfly >"$tmp/out" 2>&1
  check "on the fly: a damaged cached file is prepared again" "[ $? -eq 0 ] && grep -q 'does not verify' $tmp/out && grep -q 'prepared with' $tmp/out"
  rm -f "$cached" && cp "$tmp/neat128.mtseq" "$tmp/target.mtseq" && ln -s "$tmp/target.mtseq" "$cached"
  onfly >"$tmp/out" 2>&1
  check "on the fly: a symbolic link under the cached name is not followed; its target is left as it was" \
    "[ $? -eq 0 ] && grep -q 'is a symbolic link (not followed)' $tmp/out && [ ! -L $cached ] && cmp -s $tmp/target.mtseq $tmp/neat128.mtseq"
  chmod 0770 "$cache"
  onfly >"$tmp/out" 2>&1
  check "on the fly: a cache folder others may write is refused, naming its mode" \
    "[ $? -ne 0 ] && grep -q 'may be written by other users (mode 770)' $tmp/out && ! grep -Eq 'step +1/1' $tmp/out"
  chmod 0700 "$cache"
  mkdir -p "$tmp/elsewhere" "$tmp/xdg2/megatrain" && ln -s "$tmp/elsewhere" "$tmp/xdg2/megatrain/data-cache"
  XDG_CACHE_HOME="$tmp/xdg2" "$exec_bin" "$2/profiles/plans/tiny-cpu.json" --data "$tmp/sft.jsonl" --tokenizer "$tmp/model" --steps 1 >"$tmp/out" 2>&1
  check "on the fly: a cache folder that is a symbolic link is refused" \
    "[ $? -ne 0 ] && grep -q 'is a symbolic link, which is not followed' $tmp/out && [ -z \"\$(ls $tmp/elsewhere)\" ]"
  mkdir -p "$tmp/t"
  env -u HOME -u XDG_CACHE_HOME TMPDIR="$tmp/t" "$exec_bin" "$2/profiles/plans/tiny-cpu.json" --data "$tmp/sft.jsonl" \
    --tokenizer "$tmp/model" --steps 1 >"$tmp/out" 2>&1
  check "on the fly without HOME: the temporary folder's cache of this user" \
    "[ $? -eq 0 ] && ls $tmp/t/megatrain-data-cache-\$(id -u)/sft-*.mtseq >/dev/null"
  printf '{"instruction": "c", "output": "b"}\n' >>"$tmp/sft.jsonl"
  onfly >"$tmp/out" 2>&1
  check "on the fly: a changed dataset is prepared again" \
    "[ $? -eq 0 ] && grep -q 'prepared with' $tmp/out && [ \$(ls $cache | wc -l) -eq 2 ]"
fi
echo "$fails failed"
[ "$fails" -eq 0 ]
