#!/usr/bin/env python3
"""An outside measurement of the NIC's round trip, kumo against QEMU, sharing no code with
`kumo bench net`: iputils `ping` times the round trips, not kumo's tools.

The same netecho ELF in both VMMs (1 vCPU, 256 MiB, `ip=10.0.0.2 wait=irq`), one VM at a time on
the same tap (`kt0` in a namespace of its own, `kn`, 10.0.0.1/24): kumo's virtio-net
(`irq=direct`) and QEMU's `virtio-net-pci,disable-legacy=on` on its own tap backend (no vhost).
Runs alternate kumo, QEMU, kumo, ... `ping -A` (adaptive: as root, the next echo request goes
out as soon as the reply is in, a ping-pong like the bench's) sends COUNT requests of SIZE bytes;
the first WARMUP replies are left out; p50 and p99 are of ping's own `time=` figures (the
kernel's receive timestamp minus the send time, 1 us resolution). cpu/rt: the CPU time of the
VMM's threads other than its vCPU (/proc/PID/task/*/schedstat) during the pings, per reply.

    scripts/outside-net-rtt.py [--runs 5] [--count 10000] [--size 64] [--pin]
        [--kumo target/release/kumo] [--elf netecho.elf] [--vmms kumo,qemu]

--pin: once the guest is up, the vCPU thread goes to host CPU 1 and every other thread of the
VMM to CPU 0 (kumo's vCPU is the thread named vcpu0, QEMU's `CPU 0/KVM`: QEMU runs with
`-name netecho,debug-threads=on` so that its threads have names), as the bench's pinned
rows. Prints one line per run, each VMM's medians and a last line `ping_p50_ratio_qemu=
ping_p99_ratio_qemu= cpu_rt_ratio_qemu=` (kumo's median over QEMU's). Needs root, /dev/kvm, qemu-system-x86_64 and
a built kumo.
"""
import argparse
import glob
import math
import os
import statistics
import subprocess
import sys
import threading
import time

NS, TAP, HOST_IP, GUEST_IP, MAC = "kn", "kt0", "10.0.0.1", "10.0.0.2", "52:54:00:12:34:56"
GUEST_ARGS = [f"ip={GUEST_IP}", "wait=irq"]
WARMUP = 200


def sh(*argv):
    subprocess.run(argv, check=True, capture_output=True)


def make_tap():
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    sh("ip", "netns", "add", NS)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
    sh("ip", "netns", "exec", NS, "ip", "tuntap", "add", TAP, "mode", "tap")
    sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{HOST_IP}/24", "dev", TAP)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", TAP, "up")


class Vm:
    """A VMM process in the namespace, its output collected by a reader thread."""

    def __init__(self, argv):
        self.p = subprocess.Popen(["ip", "netns", "exec", NS] + argv, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.out = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for raw in iter(self.p.stdout.readline, b""):
            self.out.append(raw.decode(errors="replace").rstrip("\n"))

    def wait_up(self, timeout=120):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any("netecho: up" in l for l in self.out):
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("netecho did not come up:\n" + "\n".join(self.out[-20:]))

    def threads(self):
        for t in glob.glob(f"/proc/{self.p.pid}/task/*"):
            try:
                yield int(os.path.basename(t)), open(f"{t}/comm").read().strip()
            except OSError:
                pass

    def io_cpu_ns(self, vcpu):
        total = 0
        for tid, comm in self.threads():
            if comm == vcpu:
                continue
            try:
                total += int(open(f"/proc/{self.p.pid}/task/{tid}/schedstat").read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return total

    def pin(self, vcpu):
        for tid, comm in self.threads():
            sh("taskset", "-pc", "1" if comm == vcpu else "0", str(tid))

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def kumo_vm(a):
    return Vm([a.kumo, "run", "--memory", "256M", "--guest", "netecho", "--cpus", "1", "--timeout", "600",
               "--net", f"tap={TAP},mac={MAC},irq=direct", "--"] + GUEST_ARGS), "vcpu0"


def qemu_vm(a):
    return Vm(["qemu-system-x86_64", "-accel", "kvm", "-machine", "pc", "-cpu", a.qemu_cpu, "-smp", "1", "-m", "256",
               "-name", "netecho,debug-threads=on", "-nodefaults", "-display", "none", "-no-reboot", "-kernel", a.elf, "-append", " ".join(GUEST_ARGS),
               "-chardev", "stdio,id=con,signal=off", "-serial", "chardev:con",
               "-device", "isa-debug-exit,iobase=0x501,iosize=1",
               "-device", f"virtio-net-pci,netdev=n0,disable-legacy=on,mac={MAC}",
               "-netdev", f"tap,id=n0,ifname={TAP},script=no,downscript=no"]), "CPU 0/KVM"


def pct(v, q):
    """Nearest-rank, as the bench's: the ceil(q * n)-th smallest."""
    v = sorted(v)
    return v[max(1, math.ceil(q * len(v))) - 1]


def one_run(a, start):
    vm, vcpu = start(a)
    try:
        vm.wait_up()
        if a.pin:
            vm.pin(vcpu)
        cpu0 = vm.io_cpu_ns(vcpu)
        out = subprocess.run(["ip", "netns", "exec", NS, "ping", "-A", "-n", "-c", str(a.count), "-s", str(a.size),
                              "-W", "1", GUEST_IP], capture_output=True, text=True)
        cpu1 = vm.io_cpu_ns(vcpu)
    finally:
        vm.stop()
    times = [float(w[5:]) * 1e3 for l in out.stdout.splitlines() if "icmp_seq=" in l
             for w in l.split() if w.startswith("time=")]
    if len(times) <= WARMUP:
        raise RuntimeError(f"ping: {len(times)} replies of {a.count}:\n{out.stdout[-1000:]}{out.stderr[-1000:]}")
    t = times[WARMUP:]
    return dict(p50=pct(t, 0.50), p99=pct(t, 0.99), replies=len(times), cpu_rt=(cpu1 - cpu0) / 1e3 / len(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--count", type=int, default=10000)
    ap.add_argument("--size", type=int, default=64, help="ICMP payload bytes (the bench's UDP payload is 64)")
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--kumo", default="target/release/kumo")
    ap.add_argument("--elf", default=None, help="netecho.elf (default: the one cargo built)")
    ap.add_argument("--qemu-cpu", default="max,-arch-capabilities")
    ap.add_argument("--vmms", default="kumo,qemu")
    a = ap.parse_args()
    if a.count <= WARMUP:
        sys.exit(f"--count must be over {WARMUP} (the warm-up replies left out)")
    if a.elf is None:
        found = sorted(glob.glob("target/release/build/kumo-guests-*/out/netecho.elf"), key=os.path.getmtime)
        if not found:
            sys.exit("no netecho.elf: cargo build --release first, or --elf PATH")
        a.elf = found[-1]
    make_tap()
    res = {"kumo": [], "qemu": []}
    print(f"# ping -A -c {a.count} -s {a.size}, first {WARMUP} replies left out; {'pinned' if a.pin else 'unpinned'};"
          " runs alternate")
    print(f"{'run':>3} {'vmm':<5} {'p50 us':>7} {'p99 us':>7} {'cpu/rt us':>9} {'replies':>8}")
    try:
        for i in range(a.runs):
            for vmm, start in (("kumo", kumo_vm), ("qemu", qemu_vm)):
                if vmm not in a.vmms.split(","):
                    continue
                r = one_run(a, start)
                res[vmm].append(r)
                print(f"{i:>3} {vmm:<5} {r['p50']:>7.1f} {r['p99']:>7.1f} {r['cpu_rt']:>9.1f} {r['replies']:>8}",
                      flush=True)
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("p50", "p99", "cpu_rt")} for v, rs in res.items() if rs}
    for v, m in med.items():
        print(f"median {v}: p50 {m['p50']:.1f} us, p99 {m['p99']:.1f} us, cpu/rt {m['cpu_rt']:.1f} us")
    if len(med) == 2:
        k, q = med["kumo"], med["qemu"]
        print(f"ping_p50_ratio_qemu={k['p50'] / q['p50']:.3f} ping_p99_ratio_qemu={k['p99'] / q['p99']:.3f}"
              f" cpu_rt_ratio_qemu={k['cpu_rt'] / q['cpu_rt']:.3f}")


if __name__ == "__main__":
    main()
