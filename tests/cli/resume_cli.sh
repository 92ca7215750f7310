#!/usr/bin/env bash
# Checkpoints and --resume as a user runs them: 4 steps then a resume to 8 print the same losses as 8
# steps straight and end in byte-identical checkpoint files; a resume that would change the run, or a
# new run into a folder of checkpoints, is refused; SIGINT finishes the step, saves and exits 130.
set -uo pipefail
src=$2
exe="$(dirname "$1")/megatrain-exec"
plan="$src/profiles/plans/tiny-cpu.json"
tmp=$(mktemp -d)
bg=""
trap '[ -n "$bg" ] && kill -9 "$bg" 2>/dev/null; rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }
head -c 20000 /usr/share/common-licenses/GPL-3 >"$tmp/text.txt" 2>/dev/null || yes "the quick brown fox jumps over the lazy dog" | head -c 20000 >"$tmp/text.txt"
# "step 5/8 loss 5.1234": step number and loss, as printed.
losses() { awk '/^step/ {split($2, s, "/"); print s[1], $4}' "$1"; }

"$exe" "$plan" --data "$tmp/text.txt" --steps 8 --checkpoint-dir "$tmp/A" --trace "$tmp/a.mtrace" >"$tmp/a.out" 2>"$tmp/a.err"
check "8 steps straight, checkpoint at the end" "[ $? -eq 0 ] && [ -f $tmp/A/step-00000008/manifest.json ] && [ \"\$(head -n 1 $tmp/A/latest)\" = step-00000008 ]"

"$exe" "$plan" --data "$tmp/text.txt" --steps 4 --checkpoint-dir "$tmp/B" >"$tmp/b1.out" 2>"$tmp/b1.err"
check "4 steps, checkpoint at the end" "[ $? -eq 0 ] && [ -f $tmp/B/step-00000004/model.safetensors ]"
"$exe" "$plan" --data "$tmp/text.txt" --steps 8 --checkpoint-dir "$tmp/B" --resume --trace "$tmp/b.mtrace" >"$tmp/b2.out" 2>"$tmp/b2.err"
check "--resume runs steps 5..8 only" "[ $? -eq 0 ] && [ \"\$(losses $tmp/b2.out | cut -d' ' -f1 | tr '\n' ' ')\" = '5 6 7 8 ' ]"
check "the printed losses of steps 5..8 equal the straight run's" \
  "[ \"\$(losses $tmp/b2.out)\" = \"\$(losses $tmp/a.out | tail -n 4)\" ] && [ -n \"\$(losses $tmp/b2.out)\" ]"
check "the traced losses of steps 5..8 are equal as doubles" "/usr/bin/python3 - $tmp/a.mtrace $tmp/b.mtrace <<'PY'
import sqlite3, sys
a = dict(sqlite3.connect(sys.argv[1]).execute('select step, loss from steps').fetchall())
b = dict(sqlite3.connect(sys.argv[2]).execute('select step, loss from steps').fetchall())
assert sorted(b) == [4, 5, 6, 7], sorted(b)
assert all(a[s] == b[s] for s in b), [(a[s], b[s]) for s in b]
PY"
check "the final checkpoints are byte-identical (weights and moments)" \
  "cmp -s $tmp/A/step-00000008/model.safetensors $tmp/B/step-00000008/model.safetensors && cmp -s $tmp/A/step-00000008/optimizer.safetensors $tmp/B/step-00000008/optimizer.safetensors"
check "the manifest records the losses of all 8 steps" "/usr/bin/python3 - $tmp/B/step-00000008/manifest.json <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
assert m['schema'] == 'megatrain.checkpoint/1' and m['step'] == 8 and m['data']['next_step'] == 8
assert m['losses']['first_step'] == 0 and len(m['losses']['values']) == 8
PY"

"$exe" "$plan" --data "$tmp/text.txt" --steps 8 --checkpoint-dir "$tmp/B" --resume >"$tmp/out" 2>"$tmp/err"
check "resuming a finished run runs nothing" "[ $? -eq 0 ] && ! grep -q '^step' $tmp/out && grep -q 'nothing to run' $tmp/out"
"$exe" "$plan" --data "$tmp/text.txt" --steps 4 --checkpoint-dir "$tmp/B" >"$tmp/out" 2>"$tmp/err"
check "a new run into a folder of checkpoints is refused" "[ $? -ne 0 ] && grep -q -- '--resume' $tmp/err && ! grep -q '^step' $tmp/out"
"$exe" "$plan" --data "$tmp/text.txt" --checkpoint-dir "$tmp/empty" --resume >"$tmp/out" 2>"$tmp/err"
check "--resume with no checkpoint fails naming the folder" "[ $? -ne 0 ] && grep -q 'empty' $tmp/err"
/usr/bin/python3 -c "
import json; d = json.load(open('$plan')); d['training']['lr'] = 2e-3
json.dump(d, open('$tmp/other-lr.json', 'w'))"
"$exe" "$tmp/other-lr.json" --data "$tmp/text.txt" --steps 10 --checkpoint-dir "$tmp/B" --resume >"$tmp/out" 2>"$tmp/err"
check "a resume with another learning rate is refused naming training.lr" \
  "[ $? -ne 0 ] && grep -q 'training.lr' $tmp/err && ! grep -q '^step' $tmp/out"
head -c 10000 "$tmp/text.txt" >"$tmp/other.txt"
"$exe" "$plan" --data "$tmp/other.txt" --steps 10 --checkpoint-dir "$tmp/B" --resume >"$tmp/out" 2>"$tmp/err"
check "a resume on other data is refused naming data.tokens" "[ $? -ne 0 ] && grep -q 'data.tokens' $tmp/err"
tr 'a-y' 'b-z' <"$tmp/text.txt" >"$tmp/same-size.txt"
"$exe" "$plan" --data "$tmp/same-size.txt" --steps 10 --checkpoint-dir "$tmp/B" --resume >"$tmp/out" 2>"$tmp/err"
check "a resume on other data of the same size is refused naming data.fingerprint" \
  "[ $? -ne 0 ] && grep -q 'data.fingerprint' $tmp/err && [ \$(stat -c %s $tmp/same-size.txt) -eq \$(stat -c %s $tmp/text.txt) ] && ! grep -q '^step' $tmp/out"
cp -r "$tmp/B" "$tmp/C"
printf 'X' | dd of="$tmp/C/step-00000008/optimizer.safetensors" bs=1 seek=5000 conv=notrunc 2>/dev/null
"$exe" "$plan" --data "$tmp/text.txt" --steps 10 --checkpoint-dir "$tmp/C" --resume >"$tmp/out" 2>"$tmp/err"
check "a damaged checkpoint is refused naming the file and the older valid one" \
  "[ $? -ne 0 ] && grep -q 'optimizer.safetensors' $tmp/err && grep -q 'step-00000004' $tmp/err && ! grep -q '^step' $tmp/out"

# --checkpoint-compress: fp32 moments stored compressed; the resume continues the same run, and its
# final checkpoint holds the same bits (the weights' file byte for byte).
"$exe" "$plan" --data "$tmp/text.txt" --steps 4 --checkpoint-dir "$tmp/Z" --checkpoint-compress >"$tmp/z1.out" 2>"$tmp/z1.err"
check "--checkpoint-compress writes a smaller optimizer file" \
  "[ $? -eq 0 ] && grep -q 'fp32 moments compressed' $tmp/z1.out && [ \$(stat -c %s $tmp/Z/step-00000004/optimizer.safetensors) -lt \$(stat -c %s $tmp/B/step-00000004/optimizer.safetensors) ]"
"$exe" "$plan" --data "$tmp/text.txt" --steps 8 --checkpoint-dir "$tmp/Z" --resume >"$tmp/z2.out" 2>"$tmp/z2.err"
check "a resume from compressed moments prints the straight run's losses" \
  "[ $? -eq 0 ] && [ \"\$(losses $tmp/z2.out)\" = \"\$(losses $tmp/a.out | tail -n 4)\" ] && [ -n \"\$(losses $tmp/z2.out)\" ]"
check "and ends in the straight run's weights and moments, byte for byte" \
  "cmp -s $tmp/A/step-00000008/model.safetensors $tmp/Z/step-00000008/model.safetensors && cmp -s $tmp/A/step-00000008/optimizer.safetensors $tmp/Z/step-00000008/optimizer.safetensors"
/usr/bin/python3 -c "
import json; d = json.load(open('$plan')); d['optimizer']['m_format'] = 'q8'; d['optimizer']['v_format'] = 'q8'
json.dump(d, open('$tmp/q8.json', 'w'))"
"$exe" "$tmp/q8.json" --data "$tmp/text.txt" --steps 2 --checkpoint-dir "$tmp/Q" --checkpoint-compress >"$tmp/out" 2>"$tmp/err"
check "--checkpoint-compress with no fp32 moments is refused naming the formats" \
  "[ $? -ne 0 ] && grep -q 'q8/q8' $tmp/err && ! grep -q '^step' $tmp/out"

# --keep-checkpoints (docs/checkpoints.md#retention): a checkpoint after every step, the newest 2
# kept; the resume from what is left continues the straight run bit for bit.
"$exe" "$plan" --data "$tmp/text.txt" --steps 4 --checkpoint-dir "$tmp/K" --checkpoint-every 1 --keep-checkpoints 2 >"$tmp/k1.out" 2>"$tmp/k1.err"
check "--keep-checkpoints 2, a checkpoint every step: steps 3 and 4 left, nothing hidden, the removal said" \
  "[ $? -eq 0 ] && [ \"\$(ls $tmp/K | grep '^step-' | tr '\n' ' ')\" = 'step-00000003 step-00000004 ' ] && [ -z \"\$(ls -A $tmp/K | grep '^\.step')\" ] && grep -q 'removed 1 older checkpoint (keeping the newest 2): step-00000002' $tmp/k1.out"
"$exe" "$plan" --data "$tmp/text.txt" --steps 8 --checkpoint-dir "$tmp/K" --resume --keep-checkpoints 1 >"$tmp/k2.out" 2>"$tmp/k2.err"
check "the resume from what is left prints the straight run's losses and ends in its weights; keep 1 leaves step 8 alone" \
  "[ $? -eq 0 ] && [ \"\$(losses $tmp/k2.out)\" = \"\$(losses $tmp/a.out | tail -n 4)\" ] && cmp -s $tmp/A/step-00000008/model.safetensors $tmp/K/step-00000008/model.safetensors && [ \"\$(ls $tmp/K | grep '^step-' | tr '\n' ' ')\" = 'step-00000008 ' ]"
"$exe" "$plan" --data "$tmp/text.txt" --steps 2 --keep-checkpoints 2 >"$tmp/out" 2>"$tmp/err"
check "--keep-checkpoints without --checkpoint-dir is refused" "[ $? -ne 0 ] && grep -q 'checkpoint-dir' $tmp/err && ! grep -q '^step' $tmp/out"
"$exe" "$plan" --data "$tmp/text.txt" --steps 2 --checkpoint-dir "$tmp/K0" --keep-checkpoints 0 >"$tmp/out" 2>"$tmp/err"
check "--keep-checkpoints 0 is refused naming the option" "[ $? -ne 0 ] && grep -q 'keep-checkpoints' $tmp/err && ! grep -q '^step' $tmp/out"

# SIGINT: the step in progress finishes, a checkpoint is written, exit 130; the checkpoint resumes.
"$exe" "$plan" --data "$tmp/text.txt" --steps 100000 --checkpoint-dir "$tmp/S" >"$tmp/s.out" 2>"$tmp/s.err" &
bg=$!
for _ in $(seq 100); do grep -q '^step' "$tmp/s.out" 2>/dev/null && break; sleep 0.1; done
sleep 1
kill -INT "$bg"
wait "$bg"
rc=$?
bg=""
check "SIGINT exits 130 after saving" "[ $rc -eq 130 ] && grep -q 'stopped by SIGINT' $tmp/s.out && [ -f $tmp/S/latest ]"
saved=$(head -n 1 "$tmp/S/latest" 2>/dev/null | sed 's/step-0*//')
check "the checkpoint is of the last step printed" "[ -n '$saved' ] && [ \"\$(losses $tmp/s.out | tail -n 1 | cut -d' ' -f1)\" = '$saved' ]"
"$exe" "$plan" --data "$tmp/text.txt" --steps $((saved + 1)) --checkpoint-dir "$tmp/S" --resume >"$tmp/out" 2>"$tmp/err"
check "the interrupted run resumes" "[ $? -eq 0 ] && [ \"\$(losses $tmp/out | cut -d' ' -f1)\" = '$((saved + 1))' ]"

# Issue 32 rows 4, 6, 7: a resume checks the whole model, every file the manifest lists, and a
# damaged `latest`. The straight run A (8 steps) is copied for each case.
/usr/bin/python3 - "$src/profiles/models/tiny-llama-gqa.json" "$tmp/m/tiny-llama-gqa.json" "$plan" "$tmp/theta.json" <<'PY'
import json, os, sys
m = json.load(open(sys.argv[1]))
m["rope_theta"] = m.get("rope_theta", 10000.0) * 2
os.makedirs(os.path.dirname(sys.argv[2]), exist_ok=True)
json.dump(m, open(sys.argv[2], "w"))
p = json.load(open(sys.argv[3]))
p["model"] = sys.argv[2]  # the same name (the file's) and parameter count, another rope_theta
json.dump(p, open(sys.argv[4], "w"))
PY
cp -r "$tmp/A" "$tmp/R4"
"$exe" "$tmp/theta.json" --data "$tmp/text.txt" --steps 9 --checkpoint-dir "$tmp/R4" --resume >"$tmp/out" 2>"$tmp/err"
check "resume with another rope_theta under the same model name: refused naming the key" \
  "[ $? -ne 0 ] && grep -q 'the model differs from the checkpoint' $tmp/err && grep -q 'rope_theta 10000.0 -> 20000.0' $tmp/err && ! grep -q '^step' $tmp/out"
cp -r "$tmp/A" "$tmp/R7"
printf 'X' | dd of="$tmp/R7/step-00000008/config.json" bs=1 seek=3 conv=notrunc 2>/dev/null
"$exe" "$plan" --data "$tmp/text.txt" --steps 9 --checkpoint-dir "$tmp/R7" --resume >"$tmp/out" 2>"$tmp/err"
check "resume with a damaged config.json in the step: refused naming it" "[ $? -ne 0 ] && grep -q 'config.json.: checksum mismatch' $tmp/err"
rm "$tmp/R7/step-00000008/config.json"
"$exe" "$plan" --data "$tmp/text.txt" --steps 9 --checkpoint-dir "$tmp/R7" --resume >"$tmp/out" 2>"$tmp/err"
check "resume with config.json deleted: refused naming it" "[ $? -ne 0 ] && grep -q 'config.json. is missing; the manifest lists it' $tmp/err"
cp -r "$tmp/B" "$tmp/R6"
printf 'step-00000004\nxxh64 0000000000000000\n' >"$tmp/R6/latest"
"$exe" "$plan" --data "$tmp/text.txt" --steps 9 --checkpoint-dir "$tmp/R6" --resume >"$tmp/out" 2>"$tmp/err"
check "resume with a damaged 'latest': the newest step, and a note saying why" \
  "[ $? -eq 0 ] && grep -q \"note: .*latest' is damaged\" $tmp/out && grep -q 'resuming from .*step-00000008: 8 steps done' $tmp/out"

# Issue 32 rows 5 and 15: --init refuses a NaN in a weight (naming the tensor and the index) and a
# checkpoint with tensors the model does not have (a deeper model's).
/usr/bin/python3 - "$tmp/A/step-00000008/model.safetensors" "$tmp/nan" "$tmp/deeper" <<'PY'
import json, os, struct, sys
src, nan_dir, deep_dir = sys.argv[1:4]
raw = open(src, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
data = bytearray(raw[8 + n:])
def write(folder, header, data):
    os.makedirs(folder, exist_ok=True)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    open(os.path.join(folder, "model.safetensors"), "wb").write(struct.pack("<Q", len(text)) + text + bytes(data))
name = "model.layers.1.self_attn.q_proj.weight"
s0 = header[name]["data_offsets"][0]
cols = header[name]["shape"][1]
bad = bytearray(data)
bad[s0 + 4 * (cols + 2):s0 + 4 * (cols + 3)] = struct.pack("<f", float("nan"))  # element [1, 2]
write(nan_dir, header, bad)
deeper = dict(header)
end = len(data)
deeper["model.layers.9.mlp.up_proj.weight"] = {"dtype": "F32", "shape": [2, 2], "data_offsets": [end, end + 16]}
write(deep_dir, deeper, data + struct.pack("<4f", 1, 2, 3, 4))
PY
"$exe" "$plan" --data "$tmp/text.txt" --steps 1 --init "$tmp/nan" >"$tmp/out" 2>"$tmp/err"
check "--init with a NaN weight: refused naming the tensor and [1, 2], untrained" \
  "[ $? -ne 0 ] && grep -q 'tensor model.layers.1.self_attn.q_proj.weight holds NaN at \[1, 2\]' $tmp/err && ! grep -q '^step' $tmp/out"
"$exe" "$plan" --data "$tmp/text.txt" --steps 1 --init "$tmp/deeper" >"$tmp/out" 2>"$tmp/err"
check "--init with a deeper model's tensor: refused naming it" \
  "[ $? -ne 0 ] && grep -q 'does not have (model.layers.9.mlp.up_proj.weight)' $tmp/err && ! grep -q '^step' $tmp/out"
"$exe" "$plan" --data "$tmp/text.txt" --steps 1 --init "$tmp/A/step-00000008" >"$tmp/out" 2>"$tmp/err"
check "--init with the model's own checkpoint still trains" "[ $? -eq 0 ] && grep -q '^step' $tmp/out"

# Issue 32 row 9: the data file changes under a run (here it grows, which cannot crash the mapped
# reads; truncation would, and is caught the same way before the next step): the run stops naming
# the file, saves the steps done, and exits 1.
cp "$tmp/text.txt" "$tmp/live.txt"
"$exe" "$plan" --data "$tmp/live.txt" --steps 100000 --checkpoint-dir "$tmp/D9" >"$tmp/d9.out" 2>"$tmp/d9.err" &
bg=$!
for _ in $(seq 100); do grep -q '^step' "$tmp/d9.out" 2>/dev/null && break; sleep 0.1; done
echo "more text" >>"$tmp/live.txt"
wait "$bg"
rc=$?
bg=""
check "a data file that changes under the run: exit 1 naming it, the steps done saved" \
  "[ $rc -eq 1 ] && grep -q \"the data file '$tmp/live.txt' changed during the run\" $tmp/d9.err && [ -f $tmp/D9/latest ] && grep -q 'holds the steps done' $tmp/d9.err"

# Issue 32 row 3: one run per checkpoint folder. A second run (new or --resume) is refused naming
# the first's pid while it runs; once the first is killed (-9), its lock is gone and a run proceeds.
"$exe" "$plan" --data "$tmp/text.txt" --steps 100000 --checkpoint-dir "$tmp/L" >"$tmp/l.out" 2>"$tmp/l.err" &
bg=$!
for _ in $(seq 100); do grep -q '^step' "$tmp/l.out" 2>/dev/null && break; sleep 0.1; done
"$exe" "$plan" --data "$tmp/text.txt" --steps 2 --checkpoint-dir "$tmp/L" >"$tmp/out" 2>"$tmp/err"
check "a second run on a folder in use: refused naming the first's pid, untrained" \
  "[ $? -ne 0 ] && grep -q \"is in use by another megatrain-exec run (pid $bg on\" $tmp/err && ! grep -q '^step' $tmp/out"
"$exe" "$plan" --data "$tmp/text.txt" --steps 2 --checkpoint-dir "$tmp/L" --resume >"$tmp/out" 2>"$tmp/err"
check "and a --resume on it too" "[ $? -ne 0 ] && grep -q 'is in use by another megatrain-exec run' $tmp/err"
kill -9 "$bg"
wait "$bg" 2>/dev/null
bg=""
"$exe" "$plan" --data "$tmp/text.txt" --steps 1 --checkpoint-dir "$tmp/L" >"$tmp/out" 2>"$tmp/err"
check "after the first run is killed, its stale lock is taken over" "[ $? -eq 0 ] && grep -q '^step' $tmp/out"

# SIGHUP (the ssh session that started the run dropped): saved like SIGINT and SIGTERM, exit 129.
"$exe" "$plan" --data "$tmp/text.txt" --steps 100000 --checkpoint-dir "$tmp/H" >"$tmp/h.out" 2>"$tmp/h.err" &
bg=$!
for _ in $(seq 100); do grep -q '^step' "$tmp/h.out" 2>/dev/null && break; sleep 0.1; done
kill -HUP "$bg"
wait "$bg"
rc=$?
bg=""
check "SIGHUP exits 129 after saving" "[ $rc -eq 129 ] && grep -q 'stopped by SIGHUP' $tmp/h.out && [ -f $tmp/H/latest ]"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
