#!/usr/bin/env bash
# The memory figures of issue 17, measured: for small-llama on the cpu-dev-2core rig with its GPU
# memory set to 64, 128 and 256 MiB, and for the demo's tiny plan, the plan `megatrain-plan plan`
# picks (or the tiny plan as shipped) is simulated and trained for 3 steps, and the table gives
# per tier the predicted bytes (simulate --json: the compiled step's footprint), what megatrain-exec
# allocated (its trace's counters), and, for RAM, the process's anonymous resident memory (RssAnon,
# sampled from /proc) less that of `megatrain-exec --help` (the program's own heap).
# usage: bench/memory-agreement.sh [--build DIR] [--out DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=$here/build
out=""
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "memory-agreement.sh: unknown argument '$1'; accepted: --build DIR, --out DIR" >&2; exit 2 ;;
  esac
done
for b in "$build/bin/megatrain-plan" "$build/bin/megatrain-exec"; do
  [ -x "$b" ] || { echo "memory-agreement.sh: $b not found; build first" >&2; exit 2; }
done
if [ -z "$out" ]; then out=$(mktemp -d); trap 'rm -rf "$out"' EXIT; fi
mkdir -p "$out"
data=/usr/share/common-licenses/GPL-3
[ -r "$data" ] || { yes "the quick brown fox jumps over the lazy dog" | head -c 200000 >"$out/text.txt"; data=$out/text.txt; }
/usr/bin/python3 - "$here" "$build" "$out" "$data" <<'PY'
import json, os, sqlite3, subprocess, sys
here, build, out, data = sys.argv[1:5]
sys.path.insert(0, os.path.join(here, "bench"))
from anon_rss import anon_rss as rss_of
plan_bin, exec_bin = os.path.join(build, "bin/megatrain-plan"), os.path.join(build, "bin/megatrain-exec")

base_rss = rss_of([exec_bin, "--help"])
cases = []
rig = json.load(open(os.path.join(here, "profiles/hardware/cpu-dev-2core.json")))
for mib in (64, 128, 256):
    r = json.loads(json.dumps(rig))
    r["gpu"]["memory_bytes"]["value"] = float(mib << 20)
    rig_path = os.path.join(out, f"rig-{mib}.json")
    json.dump(r, open(rig_path, "w"))
    plan_path = os.path.join(out, f"small-llama-{mib}.json")
    subprocess.run([plan_bin, "plan", "--model", "small-llama", "--rig", rig_path, "--seq", "128", "--tokens-per-step", "2048",
                    "--steps", "3", "-o", plan_path], check=True, capture_output=True)
    cases.append((f"small-llama, {mib} MiB GPU", plan_path))
cases.append(("tiny-cpu.json (demo)", os.path.join(here, "profiles/plans/tiny-cpu.json")))
MiB = float(1 << 20)
rows = ["| plan | tier | predicted | allocated (trace) | error | anonymous resident memory less the program's | error |", "|---|---|---|---|---|---|---|"]
worst = 0.0
for label, path in cases:
    sim = json.loads(subprocess.run([plan_bin, "simulate", path, "--json"], check=True, capture_output=True, text=True).stdout)
    trace = os.path.join(out, os.path.basename(path) + ".mtrace")
    rss = rss_of([exec_bin, path, "--data", data, "--steps", "20", "--trace", trace]) - base_rss
    counters = dict(sqlite3.connect(trace).execute("select name, max(value) from counters group by name").fetchall())
    for tier in ("device", "pinned", "ram"):
        p, m = sim["peak_bytes"][tier], counters.get("bytes." + tier, 0.0)
        e = (p - m) / m if m else 0.0
        worst = max(worst, abs(e))
        extra = ""
        if tier == "ram":
            extra = f" {rss / MiB:.1f} MiB | {100 * (p - rss) / rss:+.1f}% |"
        else:
            extra = " | |"
        rows.append(f"| {label} | {tier} | {p / MiB:.2f} MiB | {m / MiB:.2f} MiB | {100 * e:+.2f}% |{extra}")
rows.append("")
rows.append(f"worst error against the executor's allocations: {100 * worst:.2f}%; the program's own resident set"
            f" anonymous memory (megatrain-exec --help): {base_rss / MiB:.0f} MiB")
print("\n".join(rows))
PY
