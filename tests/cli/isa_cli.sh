#!/usr/bin/env bash
# MEGATRAIN_ISA as a user sets it (docs/testing.md): a forced AdamW path trains with the same losses
# as the automatic one (every path gives the same bits), and a value that names no path, or one this
# CPU lacks, is refused before anything is loaded.
set -uo pipefail
src=$2
exe="$(dirname "$1")/megatrain-exec"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }
head -c 20000 /usr/share/common-licenses/GPL-3 >"$tmp/text.txt" 2>/dev/null || yes "the quick brown fox" | head -c 20000 >"$tmp/text.txt"

env -u MEGATRAIN_ISA "$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --steps 3 >"$tmp/auto" 2>&1
check "trains with the automatic path" "[ $? -eq 0 ] && [ \$(grep -c '^step' $tmp/auto) -eq 3 ]"
MEGATRAIN_ISA=scalar "$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --steps 3 >"$tmp/scalar" 2>&1
check "trains with the scalar path forced" "[ $? -eq 0 ] && [ \$(grep -c '^step' $tmp/scalar) -eq 3 ]"
check "the same losses on both paths" "diff <(awk '/^step/ {print \$4}' $tmp/auto) <(awk '/^step/ {print \$4}' $tmp/scalar)"

MEGATRAIN_ISA=sse9 "$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --steps 3 >"$tmp/out" 2>"$tmp/err"
rc=$?
check "an unknown MEGATRAIN_ISA exits 1" "[ $rc -eq 1 ]"
check "it names the value and the accepted ones" "grep -q 'MEGATRAIN_ISA=sse9: unknown instruction set; accepted: auto, scalar' $tmp/err"
check "nothing was trained" "! grep -q '^step' $tmp/out"
if ! grep -qw avx512bw /proc/cpuinfo; then
  MEGATRAIN_ISA=avx512 "$exe" "$src/profiles/plans/tiny-cpu.json" --data "$tmp/text.txt" --steps 3 >"$tmp/out" 2>"$tmp/err"
  check "a path this CPU lacks is refused" "[ $? -eq 1 ] && grep -q 'has no avx512' $tmp/err"
fi
[ $fails -eq 0 ]
