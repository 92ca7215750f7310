#!/usr/bin/env bash
# scripts/gpu-check.sh without a GPU (issue 31): a stand-in nvidia-smi on the PATH and stand-in
# bundles. With programs that hang, GPU_CHECK_DEADLINE_S bounds the whole run: it ends within 15 s
# of its deadline, prints its table with the hung and unreached steps, and exits 1. With test
# programs whose every test skips (a driver too old for the runtime looks like that), it exits 1
# and names the skipped tests; the one skip expected on a GPU machine (the refusal without a GPU)
# is not a failure. The training runs' losses are checked: a first loss far from ln V, or a loss
# that does not fall, is a failure named in the table.
set -uo pipefail
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); sed 's/^/  out: /' "$tmp/log" | tail -30; else echo "ok: $1"; fi; }

mkdir -p "$tmp/bin" "$tmp/hang" "$tmp/skip"
cat >"$tmp/bin/nvidia-smi" <<'SH'
#!/usr/bin/env bash
case "$*" in
  -L) echo "GPU 0: Stand-in H200 (UUID: GPU-0)" ;;
  --query-gpu*) echo "Stand-in H200, 143771 MiB, 580.00" ;;
  *) echo "| NVIDIA-SMI 580.00   Driver Version: 580.00   CUDA Version: 13.0 |" ;;
esac
SH
for p in megatrain-exec megatrain-plan megatrain-bench-cuda megatrain_kernels_tests megatrain_executor_tests; do
  printf '#!/usr/bin/env bash\nexec sleep 1000\n' >"$tmp/hang/$p"
  printf '#!/usr/bin/env bash\nexit 0\n' >"$tmp/skip/$p"
done
# Test programs that list their tests and skip each one, as gtest prints it.
for p in megatrain_kernels_tests megatrain_executor_tests; do
  cat >"$tmp/skip/$p" <<'SH'
#!/usr/bin/env bash
if [ "${1:-}" = --gtest_list_tests ]; then printf 'CudaOpsT/fp32.  # TypeParam = float\n  RmsNorm\nCudaTraining.\n  Fp32\n'; exit 0; fi
filter=${1#--gtest_filter=}
suite=${filter%%.*}
suite=${suite%%:*}
echo "[ RUN      ] $suite.First"
echo "[  SKIPPED ] $suite.First (0 ms)"
echo "[ RUN      ] CudaTraining.WithoutAGpuCudaIsRefusedWithTheReason"
echo "[  SKIPPED ] CudaTraining.WithoutAGpuCudaIsRefusedWithTheReason (0 ms)"
echo "[  PASSED  ] 0 tests."
echo "[  SKIPPED ] 2 tests, listed below:"
echo "[  SKIPPED ] $suite.First"
echo "[  SKIPPED ] CudaTraining.WithoutAGpuCudaIsRefusedWithTheReason"
SH
done
# A training program that prints the losses it is given, as megatrain-exec prints its steps.
cat >"$tmp/skip/megatrain-exec" <<'SH'
#!/usr/bin/env bash
i=0
for l in ${STANDIN_LOSSES:-}; do i=$((i + 1)); echo "step $i/6  loss $l  1000 tokens/s"; done
SH
chmod +x "$tmp"/bin/* "$tmp"/hang/* "$tmp"/skip/*

start=$(date +%s)
PATH="$tmp/bin:$PATH" GPU_CHECK_DEADLINE_S=20 OUT="$tmp/out-hang" bash "$src/scripts/gpu-check.sh" "$tmp/hang" >"$tmp/log" 2>&1
rc=$?
took=$(($(date +%s) - start))
check "hung programs: exit 1 (got $rc)" "[ $rc -eq 1 ]"
check "hung programs: ends within 15 s of a 20 s deadline (took $took s)" "[ $took -le 35 ]"
check "hung programs: the table is printed" "grep -q '^## gpu-check: Stand-in H200' $tmp/log && grep -q '^| check | result |' $tmp/log"
check "hung programs: the smoke pass is named as the hang" "grep -q 'tests smoke: still running after its limit' $tmp/log"
check "hung programs: the unreached steps are rows" "grep -q '| failed | not run: the deadline of 20 s has passed' $tmp/log"
check "hung programs: the versions come first" "grep -q '| CUDA version the driver supports | 13.0 |' $tmp/log"

PATH="$tmp/bin:$PATH" GPU_CHECK_DEADLINE_S=60 OUT="$tmp/out-skip" STANDIN_LOSSES="10.70 10.71 10.69 10.70 10.72 10.70" \
  bash "$src/scripts/gpu-check.sh" "$tmp/skip" >"$tmp/log" 2>&1
rc=$?
check "skipped tests: exit 1 (got $rc)" "[ $rc -eq 1 ]"
check "skipped tests: each named once as a failure" "grep -q 'FAILED: tests smoke: skipped, which on a GPU machine means the GPU was not usable: CudaDevice.First' $tmp/log"
check "skipped tests: counted once each" "grep -q '| tests executor:CudaTraining | passed=0 failed=0 skipped=2 rc=0 |' $tmp/log"
check "skipped tests: the expected skip is not a failure" "! grep -q 'usable: CudaTraining.WithoutAGpu' $tmp/log"
check "skipped tests: the table is printed" "grep -q '^| check | result |' $tmp/log"
check "flat losses: a failure for each run" "grep -q 'FAILED: train 1b: the loss did not fall: 10.700 -> 10.700' $tmp/log && grep -q 'FAILED: train 7b-shaped: the loss did not fall' $tmp/log"

PATH="$tmp/bin:$PATH" GPU_CHECK_DEADLINE_S=60 OUT="$tmp/out-far" STANDIN_LOSSES="3.0 2.5 2.0" \
  bash "$src/scripts/gpu-check.sh" "$tmp/skip" >"$tmp/log" 2>&1
check "a first loss far from ln V: a failure" "grep -q 'FAILED: train 1b: the first loss 3.000 is not within 1 of ln V = 10.373 (V = 32000)' $tmp/log"

PATH="$tmp/bin:$PATH" GPU_CHECK_DEADLINE_S=60 OUT="$tmp/out-falls" STANDIN_LOSSES="10.80 10.20 9.60 9.10 8.70 8.40" \
  bash "$src/scripts/gpu-check.sh" "$tmp/skip" >"$tmp/log" 2>&1
check "losses that fall from ln V: no loss failure" "! grep -q 'FAILED: train' $tmp/log && grep -q 'loss 10.80 -> 8.40' $tmp/log"

# No GPU at all (nvidia-smi finds none): a clear refusal, exit 2, still with the table.
mkdir -p "$tmp/nogpu"
printf '#!/usr/bin/env bash\necho "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver." >&2\nexit 9\n' >"$tmp/nogpu/nvidia-smi"
chmod +x "$tmp/nogpu/nvidia-smi"
PATH="$tmp/nogpu:$PATH" GPU_CHECK_DEADLINE_S=20 OUT="$tmp/out-none" bash "$src/scripts/gpu-check.sh" "$tmp/skip" >"$tmp/log" 2>&1
rc=$?
check "no GPU: exit 2 (got $rc)" "[ $rc -eq 2 ] && grep -q 'no NVIDIA GPU here' $tmp/log && grep -q '^| check | result |' $tmp/log"
echo "$fails failed"
[ "$fails" -eq 0 ]
