#!/usr/bin/env bash
# The NVMe tier's headline run (issue 9): Sheared-LLaMA-2.7B's shape, whose training state (48.6 GB)
# is about twice this 24 GiB machine's RAM, on the CPU backend with master weights and Adam states on
# the drive. Profiles the machine (the storage probe over a 24 GiB file, larger than the VM host's
# cache), gives the planner a 20 GiB RAM budget, plans, simulates, trains 5 steps and prints the
# measured against the predicted step time. Needs about 80 GB free in DIR and 6-8 minutes.
#
# usage: bench/nvme-headline.sh DIR   (results in DIR; bench/nvme-headline/ holds the 2026-12-02 run)
set -euo pipefail
dir=${1:?usage: bench/nvme-headline.sh DIR}
bin=${MEGATRAIN_BIN:-build/bin}
mkdir -p "$dir"
"$bin/megatrain-plan" profile --storage "$dir" --storage-gib 24 -o "$dir/rig.json" >"$dir/profile.log" 2>&1
/usr/bin/python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
r = json.load(open(f"{d}/rig.json"))
r["name"] += "-ram20"
r["host"]["ram_bytes"] = {"value": 20 * 2**30, "provenance": {"kind": "estimate", "source": "RAM budget for the headline run: 20 GiB, leaving room for the OS and page cache"}}
r["host"]["pinnable_bytes"] = {"value": 18 * 2**30, "provenance": {"kind": "estimate", "source": "90% of the 20 GiB budget (the CPU backend page-locks nothing)"}}
json.dump(r, open(f"{d}/rig-ram20.json", "w"), indent=1)
PY
"$bin/megatrain-plan" plan --model sheared-llama-2.7b --rig "$dir/rig-ram20.json" --seq 128 --tokens-per-step 128 -o "$dir/plan.json" | tee "$dir/plan.log"
# A fresh 2.7B model without warm-up needs a small learning rate to fall steadily (1e-4 spikes).
/usr/bin/python3 -c "
import json; p = json.load(open('$dir/plan.json')); p['training'].update({'lr': 1e-5, 'warmup_steps': 0, 'data_order': 'sequential'})
json.dump(p, open('$dir/plan.json', 'w'), indent=1)"
cat README.md docs/*.md >"$dir/data.txt"
/usr/bin/time -v "$bin/megatrain-exec" "$dir/plan.json" --data "$dir/data.txt" --steps 5 --backend cpu --trace "$dir/run.mtrace" 2>&1 | tee "$dir/run.log"
/usr/bin/python3 - "$dir" <<'PY'
import json, sqlite3, sys
d = sys.argv[1]
pred = json.load(open(f"{d}/plan.json"))["predicted"]["step_time_s"]
steps = sqlite3.connect(f"{d}/run.mtrace").execute("select step, loss, time_s from steps order by step").fetchall()
steady = [t for s, _, t in steps[1:]]
mean = sum(steady) / len(steady)
print(f"predicted step {pred:.1f} s; measured steps 2..{len(steps)}: " + ", ".join(f"{t:.1f}" for t in steady) +
      f" s, mean {mean:.1f} s ({100 * (mean / pred - 1):+.1f}%; target within 25%)")
print("losses: " + ", ".join(f"{l:.3f}" for _, l, _ in steps))
PY
