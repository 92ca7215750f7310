#!/usr/bin/env bash
# The NVMe tier's store against fio on the same drive: `megatrain-bench io` (exec::NvmeStore,
# sequential whole-store write and read) and fio with the same file size, block size and queue depth
# (O_DIRECT, io_uring, one job), in one run. Target (issue 9): at least 0.90 of fio both ways.
# A virtual disk's speed drifts by tens of percent within a minute, so the two take turns: ROUNDS
# rounds of (megatrain, fio write, fio read), and the table gives the median of each over the rounds.
#
# usage: bench/compare-fio.sh [--json] DIR [FILE_MIB (2048)] [BLOCK_KIB (1024)] [QUEUE_DEPTH (32)]
#   MEGATRAIN_BENCH=path/to/megatrain-bench overrides the binary (default build/bin/megatrain-bench);
#   ROUNDS=n the number of rounds (default 3).
#   Exit 0 when both were measured (met or not: the table says), 1 on an error.
set -euo pipefail

usage="usage: bench/compare-fio.sh [--json] DIR [FILE_MIB (default 2048)] [BLOCK_KIB (default 1024)] [QUEUE_DEPTH (default 32)]"
json=0
if [[ ${1:-} == --json ]]; then
  json=1
  shift
fi
if [[ $# -lt 1 || $# -gt 4 || ${1:-} == -* ]]; then
  echo "$usage" >&2
  exit 1
fi
dir=$1
file_mib=${2:-2048}
block_kib=${3:-1024}
queue_depth=${4:-32}
repeat=3  # per round: megatrain-bench's passes (median) and fio's loops (mean)
rounds=${ROUNDS:-3}

for pair in "FILE_MIB:$file_mib" "BLOCK_KIB:$block_kib" "QUEUE_DEPTH:$queue_depth" "ROUNDS:$rounds"; do
  name=${pair%%:*} value=${pair#*:}
  if ! [[ $value =~ ^[1-9][0-9]*$ ]]; then
    echo "compare-fio: $name '$value' is not a positive whole number; $usage" >&2
    exit 1
  fi
done
if (( block_kib % 4 != 0 )); then
  echo "compare-fio: BLOCK_KIB $block_kib is not a multiple of 4 (O_DIRECT needs 4 KiB-aligned blocks)" >&2
  exit 1
fi
if [[ ! -d $dir ]]; then
  echo "compare-fio: '$dir' is not a directory; accepted: an existing, writable directory on the drive to measure" >&2
  exit 1
fi

root=$(cd "$(dirname "$0")/.." && pwd)
bench=${MEGATRAIN_BENCH:-$root/build/bin/megatrain-bench}
if [[ ! -x $bench ]]; then
  echo "compare-fio: no megatrain-bench at '$bench'; build it first (cmake --preset default && cmake --build build," >&2
  echo "  or ./scripts/test.sh), or point MEGATRAIN_BENCH at one built with the executor" >&2
  exit 1
fi
if ! command -v fio >/dev/null 2>&1; then
  echo "compare-fio: fio is not installed; apt-get install fio (or ./scripts/setup.sh)" >&2
  exit 1
fi
py=/usr/bin/python3
[[ -x $py ]] || py=$(command -v python3 || true)
if [[ -z $py ]]; then
  echo "compare-fio: python3 is needed to read the JSON results; apt-get install python3" >&2
  exit 1
fi

fio_file=$dir/megatrain-fio-$$.bin
tmp=$(mktemp -d)
cleanup() { rm -f -- "$fio_file"; rm -rf -- "$tmp"; }
trap cleanup EXIT
trap 'exit 1' INT TERM HUP PIPE

# megatrain-bench io (it removes its own files, also on error).
run_megatrain() {  # name
  if ! "$bench" io --dir "$dir" --file-mib "$file_mib" --block-kib "$block_kib" --queue-depth "$queue_depth" \
       --repeat "$repeat" --json >"$tmp/megatrain-$1.json" 2>"$tmp/megatrain.err"; then
    echo "compare-fio: megatrain-bench io failed:" >&2
    cat "$tmp/megatrain.err" >&2
    exit 1
  fi
}

# fio: one unmeasured write lays the file out (megatrain-bench also writes once before measuring,
# so neither pays for allocating extents in the measured passes), then write, then read.
run_fio() {  # name rw loops
  if ! fio --name="megatrain-$1" --filename="$fio_file" --size="${file_mib}M" --bs="${block_kib}k" \
       --iodepth="$queue_depth" --direct=1 --ioengine=io_uring --rw="$2" --numjobs=1 --loops="$3" \
       --output-format=json --output="$tmp/fio-$1.json" >"$tmp/fio-$1.log" 2>&1; then
    echo "compare-fio: fio ($2) failed:" >&2
    cat "$tmp/fio-$1.log" >&2
    [[ -s $tmp/fio-$1.json ]] && cat "$tmp/fio-$1.json" >&2
    exit 1
  fi
}
run_fio layout write 1
for ((i = 0; i < rounds; ++i)); do
  [[ $json == 1 ]] || echo "compare-fio: round $((i + 1)) of $rounds" >&2
  run_megatrain "$i"
  run_fio "write-$i" write "$repeat"
  run_fio "read-$i" read "$repeat"
done

# The table (or one JSON object).
"$py" - "$tmp" "$json" "$dir" "$(fio --version)" "$rounds" <<'PY'
import json, sys
tmp, as_json, d, fio_version, rounds = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4], int(sys.argv[5])

def median(v):
    v = sorted(v)
    k = len(v)
    return v[k // 2] if k % 2 else 0.5 * (v[k // 2 - 1] + v[k // 2])

def fio_gbps(name, direction):
    with open(tmp + "/fio-" + name + ".json") as f:
        text = f.read()
    doc = json.loads(text[text.index("{"):])  # fio may put notes before the JSON
    job = doc["jobs"][0]
    if job.get("error"):
        sys.exit("compare-fio: fio %s reported error %s" % (direction, job["error"]))
    return job[direction]["bw_bytes"] / 1e9

runs = [json.load(open("%s/megatrain-%d.json" % (tmp, i))) for i in range(rounds)]
per_round = [{"megatrain": {k: runs[i][k + "_gbps"] for k in ("read", "write")},
              "fio": {"read": fio_gbps("read-%d" % i, "read"), "write": fio_gbps("write-%d" % i, "write")}}
             for i in range(rounds)]
mt = dict(runs[0])
mt["other_load"] = max(r.get("other_load", 0) for r in runs)
fio = {}
for k in ("read", "write"):
    mt[k + "_gbps"] = median([p["megatrain"][k] for p in per_round])
    fio[k + "_gbps"] = median([p["fio"][k] for p in per_round])
ratio = {k: (mt[k + "_gbps"] / fio[k + "_gbps"] if fio[k + "_gbps"] > 0 else None) for k in ("read", "write")}
spread = {k: [p["megatrain"][k] / p["fio"][k] for p in per_round if p["fio"][k] > 0] for k in ("read", "write")}
target = 0.90
if as_json:
    print(json.dumps({"megatrain": mt, "fio": fio, "ratio": ratio, "target": target, "rounds": rounds,
                      "per_round": per_round, "dir": d, "fio_version": fio_version}))
    sys.exit(0)
print("compare-fio: %s, %d MiB, block %d KiB, queue depth %d; GB/s = 1e9 bytes/s; median of %d rounds" %
      (d, mt["file_bytes"] >> 20, mt["block_bytes"] >> 10, mt["queue_depth"], rounds))
print("  megatrain: exec::NvmeStore (%s), each round the median of %d passes" % (mt["engine"], mt.get("repeat", 0)))
print("  fio:       %s, --direct=1 --ioengine=io_uring --numjobs=1, each round the mean of its loops" % fio_version)
print("  %-9s %14s %9s %8s %15s %8s  %s" % ("direction", "megatrain GB/s", "fio GB/s", "ratio", "rounds' ratios",
                                           "target", "status"))
for k in ("read", "write"):
    r = ratio[k]
    status = "met" if r is not None and r >= target else "NOT met"
    rng = "%.2f-%.2f" % (min(spread[k]), max(spread[k])) if spread[k] else "n/a"
    print("  %-9s %14.3f %9.3f %8s %15s %8s  %s" % (k, mt[k + "_gbps"], fio[k + "_gbps"],
          "%.3f" % r if r is not None else "n/a", rng, ">= %.2f" % target, status))
if mt["other_load"] > 0.05:
    print("  other processes used up to %.0f%% of the machine during megatrain's runs: noisy, rerun when quiet" %
          (100 * mt["other_load"]))
PY
