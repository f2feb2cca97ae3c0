#!/usr/bin/env python3
"""Reads the ftrace of `TRACE=1 scripts/net-rtt.sh free 1 N KUMO` (/tmp/net-rtt.trace, or the
path given) and sorts its round trips by where the threads ran: each round trip runs from one
wake-up of the host client (`kumo-bench`) to the next; its key is the CPUs the NIC thread
(`net0`), the vCPU (`vcpu0`) and the client ran on in it, and whether a thread was migrated.
Prints how many round trips each placement had and how many of them were slower than 120 µs."""
import collections
import re
import sys

SLOW_US = 120
PAT = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+):\s+(\w+):\s*(.*)$")


def cpus(seg, name):
    return tuple(sorted({e[2] for e in seg if e[1] == name or (e[3] == "sched_switch" and "next_comm=" + name in e[4])}))


def main():
    ev = []
    for line in open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/net-rtt.trace"):
        m = PAT.match(line)
        if m:
            ev.append((float(m.group(4)) * 1e6, m.group(1), int(m.group(3)), m.group(5), m.group(6)))
    wakes = [i for i, e in enumerate(ev) if e[3] == "sched_wakeup" and "comm=kumo-bench" in e[4]]
    slow, every = collections.Counter(), collections.Counter()
    for a, b in zip(wakes, wakes[1:]):
        seg = ev[a : b + 1]
        key = (cpus(seg, "net0"), cpus(seg, "vcpu0"), cpus(seg, "kumo-bench"),
               any(e[3] == "sched_migrate_task" for e in seg))
        every[key] += 1
        slow[key] += ev[b][0] - ev[a][0] > SLOW_US
    print(f"{sum(every.values())} round trips; net0 CPUs, vcpu0 CPUs, client CPUs, a migration: slow (> {SLOW_US} us) of all")
    for key, n in every.most_common():
        print(f"  {key}: {slow[key]} of {n}")


if __name__ == "__main__":
    main()
