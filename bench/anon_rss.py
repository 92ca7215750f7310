"""The most anonymous resident memory (RssAnon: heap and mmap'd arrays, not the program's file pages,
whose residency the kernel varies) a command holds, sampled from /proc every 10 ms. Shared by
bench/validate-cost-model.sh and bench/memory-agreement.sh."""
import subprocess
import sys
import time


def anon_rss(cmd, what=None):
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    most = 0
    while p.poll() is None:
        try:
            for line in open(f"/proc/{p.pid}/status"):
                if line.startswith("RssAnon:"):
                    most = max(most, int(line.split()[1]) * 1024)
        except OSError:
            pass
        time.sleep(0.01)
    err = p.stderr.read().decode()
    if p.returncode != 0:
        sys.exit(f"{what or ' '.join(cmd)} failed: {err}")
    return most
