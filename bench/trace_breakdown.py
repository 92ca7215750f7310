#!/usr/bin/env python3
"""Per-kind time of one step in two .mtrace files (predicted and measured, or plan A and B).

usage: trace_breakdown.py A.mtrace B.mtrace [--step N]

For each span kind (forward, backward, h2d, optimizer, ...) prints the count, the summed duration in
the chosen step and the mean per span, side by side, with B/A. The step defaults to the last step
of each trace (the simulator's steady state; for a measured run, its last step).
"""
import sqlite3
import sys


def per_kind(path, step):
    db = sqlite3.connect(path)
    if step is None:
        step = db.execute("select max(step) from spans where step >= 0").fetchone()[0]
    rows = db.execute(
        "select kind, count(*), sum(end_ns - start_ns) from spans where step = ? group by kind", (step,)).fetchall()
    return step, {k: (n, t / 1e9) for k, n, t in rows}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    step = None
    if "--step" in sys.argv:
        step = int(sys.argv[sys.argv.index("--step") + 1])
        args = [a for a in args if a != str(step)]
    if len(args) != 2:
        sys.exit(__doc__)
    sa, a = per_kind(args[0], step)
    sb, b = per_kind(args[1], step)
    print(f"{'kind':<18}{'A n':>6}{'A total':>12}{'A mean':>12}{'B n':>6}{'B total':>12}{'B mean':>12}{'B/A':>8}"
          f"   (A step {sa}, B step {sb})")
    for k in sorted(set(a) | set(b)):
        na, ta = a.get(k, (0, 0.0))
        nb, tb = b.get(k, (0, 0.0))
        ratio = f"{tb / ta:8.2f}" if ta > 0 else "       -"
        print(f"{k:<18}{na:>6}{ta * 1e3:>10.2f}ms{(ta / na * 1e3 if na else 0):>10.3f}ms"
              f"{nb:>6}{tb * 1e3:>10.2f}ms{(tb / nb * 1e3 if nb else 0):>10.3f}ms{ratio}")


if __name__ == "__main__":
    main()
