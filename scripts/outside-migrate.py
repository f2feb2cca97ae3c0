#!/usr/bin/env python3
"""An outside measurement of live migration, kumo against QEMU, sharing no code with
`kumo bench migrate`: the check that the bench's comparison tells the truth.

The same memtouch ELF in both VMMs, 1 vCPU, the same memory, over loopback TCP to a destination
whose memory is faulted in beforehand (kumo `--incoming ... --memory`, QEMU `-mem-prealloc`),
QEMU's bandwidth uncapped. Runs alternate kumo, QEMU, kumo, ... Each guest is started afresh for
each run. Times are taken on the host: from the command that starts the migration to the moment
the host learns it completed (kumo: `kumo migrate` exits; QEMU: `query-migrate` polled every
5 ms says completed), next to each VMM's own figures. The guest's writes/s come from its
`progress` lines, stamped with the host time they arrived; kept = writes/s during / before;
lost ms = (1 - kept) x host ms, the guest's work the migration cost at its rate before (a
faster migration keeps less of the rate for less time: kept alone reads against it).

    scripts/outside-migrate.py [--mib 512] [--runs 3] [--target 30|default] [--engine zerocopy]
        [--connections 1] [--workload flat|paper|busy] [--kumo target/release/kumo]

Prints one line per run and the medians. Needs /dev/kvm, qemu-system-x86_64 and a built kumo.
"""
import argparse
import glob
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WORKLOADS = {
    "flat": ["pages=100000", "mode=random", "prefill=1"],
    "paper": ["pages=100000", "mode=random", "prefill=1", "rate=52500"],
    "busy": ["pages=1", "mode=random", "prefill=1"],
}
WINDOW = 0.5  # seconds of guest progress before and after


class Stamped:
    """A child process whose stdout lines are kept with the host time they arrived."""

    def __init__(self, argv, **kw):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        self.lines, self.err = [], []
        threading.Thread(target=self._read, args=(self.p.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.p.stderr, self.err), daemon=True).start()

    @staticmethod
    def _read(f, into):
        for raw in iter(f.readline, b""):
            into.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

    def wait_line(self, needle, timeout, err=False):
        end = time.monotonic() + timeout
        src = self.err if err else self.lines
        while time.monotonic() < end:
            if any(needle in l for _, l in src):
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.01)
        tail = "\n".join(l for _, l in (self.lines + self.err)[-20:])
        raise RuntimeError(f"no line with {needle!r} within {timeout} s:\n{tail}")

    def send(self, b):
        self.p.stdin.write(b)
        self.p.stdin.flush()

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def progress(lines):
    out = []
    for at, l in lines:
        if l.startswith("memtouch: progress"):
            w = [x for x in l.split() if x.startswith("writes=")]
            if w:
                out.append((at, float(w[0][7:])))
    return out


def rate(p, a, b):
    """Writes/s between host times a and b, interpolating the progress lines."""

    def at(t):
        for (t0, w0), (t1, w1) in zip(p, p[1:]):
            if t0 <= t <= t1:
                return w0 + (w1 - w0) * (t - t0) / max(t1 - t0, 1e-9)
        return None

    x, y = at(a), at(b)
    return None if x is None or y is None or b <= a else (y - x) / (b - a)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_progress_after(lines_fn, t, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(at >= t for at, _ in progress(lines_fn())):
            return
        time.sleep(0.02)
    raise RuntimeError("no guest progress after the migration")


def kept(lines_fn, t0, t1):
    wait_progress_after(lines_fn, t1 + WINDOW)
    p = progress(lines_fn())
    before, during = rate(p, t0 - WINDOW, t0), rate(p, t0, t1)
    return before, during, (during / before if before and during is not None else None)


def run_kumo(a, tmp, guest):
    mem = f"{a.mib}M"
    api = os.path.join(tmp, "src.sock")
    src = Stamped([a.kumo, "run", "--guest", "memtouch", "--memory", mem, "--timeout", "600", "--api-socket", api]
                  + guest + ["until_input=1", "report_ms=100"])
    dst = None
    try:
        src.wait_line("memtouch: progress", 300)
        port = free_port()
        dst = Stamped([a.kumo, "run", "--incoming", f"tcp:127.0.0.1:{port}", "--memory", mem, "--timeout", "600",
                       "--api-socket", os.path.join(tmp, "dst.sock")])
        dst.wait_line("waiting for a migration", 120, err=True)
        time.sleep(WINDOW + 0.2)
        cmd = [a.kumo, "--api-socket", api, "migrate", "--to", f"tcp:127.0.0.1:{port}", "--engine", a.engine,
               "--connections", str(a.connections), "--json"]
        if a.target != "default":
            cmd += ["--downtime-ms", a.target]
        t0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        t1 = time.monotonic()
        if out.returncode != 0:
            raise RuntimeError(f"kumo migrate failed: {out.stderr[-2000:]}")
        rep = json.loads(out.stdout.strip().splitlines()[-1])
        rep = rep.get("report", rep)
        if a.verbose:
            rounds = " ".join(f"{x['pages']}/{x['ms']:.0f}ms" for x in rep.get("rounds", []))
            print(f"    kumo: pages/round {rounds}; {rep['total_pages']} pages", flush=True)
        b, d, k = kept(lambda: src.lines + dst.lines, t0, t1)
        dst.send(b"q")
        return dict(host_ms=(t1 - t0) * 1e3, own_ms=rep["total_ms"], down_ms=rep["downtime_ms"], before=b,
                    during=d, kept=k, rounds=len(rep.get("rounds", [])))
    finally:
        src.stop()
        if dst:
            dst.stop()


class Qmp:
    def __init__(self, path, timeout=30):
        end = time.monotonic() + timeout
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(path)
                break
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
        self.f = self.s.makefile("rwb")
        self.read()
        self.cmd("qmp_capabilities")

    def read(self):
        while True:
            v = json.loads(self.f.readline())
            if "event" not in v:
                return v

    def cmd(self, execute, args=None):
        m = {"execute": execute}
        if args:
            m["arguments"] = args
        self.f.write(json.dumps(m).encode() + b"\n")
        self.f.flush()
        v = self.read()
        if "error" in v:
            raise RuntimeError(f"QMP {execute}: {v['error']}")
        return v["return"]


def qemu(a, tmp, tag, guest, incoming=None):
    q = os.path.join(tmp, f"{tag}.qmp")
    argv = ["qemu-system-x86_64", "-accel", "kvm", "-machine", "pc", "-cpu", a.qemu_cpu, "-smp", "1", "-m",
            str(a.mib), "-nodefaults", "-display", "none", "-no-reboot", "-kernel", a.elf, "-append",
            " ".join(guest + ["until_input=1", "report_ms=100"]), "-chardev", "stdio,id=con,signal=off", "-serial",
            "chardev:con", "-device", "isa-debug-exit,iobase=0x501,iosize=1", "-qmp", f"unix:{q},server=on,wait=off"]
    if incoming:
        argv += ["-mem-prealloc", "-incoming", f"tcp:127.0.0.1:{incoming}"]
    p = Stamped(argv)
    return p, Qmp(q)


def run_qemu(a, tmp, guest):
    src, sq = qemu(a, tmp, "src", guest)
    dst = None
    try:
        src.wait_line("memtouch: progress", 300)
        port = free_port()
        dst, _ = qemu(a, tmp, "dst", guest, incoming=port)
        time.sleep(WINDOW + 0.2)
        params = {"max-bandwidth": 100_000_000_000}
        if a.target != "default":
            params["downtime-limit"] = int(a.target)
        sq.cmd("migrate-set-parameters", params)
        t0 = time.monotonic()
        sq.cmd("migrate", {"uri": f"tcp:127.0.0.1:{port}"})
        while True:
            info = sq.cmd("query-migrate")
            if info["status"] == "completed":
                break
            if info["status"] in ("failed", "cancelled"):
                raise RuntimeError(f"QEMU migration {info['status']}: {info}")
            if time.monotonic() - t0 > 60:
                raise RuntimeError("QEMU migration not done within 60 s")
            time.sleep(0.005)
        t1 = time.monotonic()
        b, d, k = kept(lambda: src.lines + dst.lines, t0, t1)
        ram = info["ram"]
        if a.verbose:
            print(f"    QEMU: normal {ram['normal']} zero {ram['duplicate']} transferred {ram['transferred']}"
                  f" setup {info.get('setup-time')} ms, mbps {ram.get('mbps')}", flush=True)
        return dict(host_ms=(t1 - t0) * 1e3, own_ms=info["total-time"], down_ms=info["downtime"], before=b,
                    during=d, kept=k, rounds=ram["dirty-sync-count"])
    finally:
        src.stop()
        if dst:
            dst.stop()


def fmt(v, p=1):
    return "-" if v is None else f"{v:.{p}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--target", default="30", help="downtime target/limit in ms, or 'default'")
    ap.add_argument("--engine", default="zerocopy")
    ap.add_argument("--connections", type=int, default=1)
    ap.add_argument("--workload", default="flat", choices=sorted(WORKLOADS))
    ap.add_argument("--kumo", default="target/release/kumo")
    ap.add_argument("--elf", default=None, help="memtouch.elf (default: the one cargo built)")
    ap.add_argument("--qemu-cpu", default="max,-arch-capabilities")
    ap.add_argument("--vmms", default="kumo,qemu", help="which VMMs to run, in turn (kumo,qemu)")
    ap.add_argument("-v", "--verbose", action="store_true", help="each run's pages per round (kumo), RAM counts (QEMU)")
    a = ap.parse_args()
    if a.elf is None:
        found = sorted(glob.glob("target/release/build/kumo-guests-*/out/memtouch.elf"), key=os.path.getmtime)
        if not found:
            sys.exit("no memtouch.elf: cargo build --release first, or --elf PATH")
        a.elf = found[-1]
    guest = WORKLOADS[a.workload]
    res = {"kumo": [], "qemu": []}
    print(f"# {a.workload} {a.mib} MiB, target {a.target}, kumo {a.engine} x{a.connections}, runs alternate")
    print(f"{'run':>3} {'vmm':<5} {'host ms':>8} {'own ms':>8} {'down ms':>8} {'before/s':>10} {'during/s':>10}"
          f" {'kept':>6} {'lost ms':>7} {'rounds':>6}")
    def lost(r):
        return None if r["kept"] is None else (1 - r["kept"]) * r["host_ms"]

    for i in range(a.runs):
        for vmm, fn in (("kumo", run_kumo), ("qemu", run_qemu)):
            if vmm not in a.vmms.split(","):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                r = fn(a, tmp, guest)
            r["lost_ms"] = lost(r)
            res[vmm].append(r)
            print(f"{i:>3} {vmm:<5} {fmt(r['host_ms'], 0):>8} {fmt(r['own_ms'], 0):>8} {fmt(r['down_ms']):>8}"
                  f" {fmt(r['before'], 0):>10} {fmt(r['during'], 0):>10} {fmt(r['kept'], 3):>6} {fmt(r['lost_ms'], 0):>7} {r['rounds']:>6}",
                  flush=True)

    def med(vmm, k):
        v = [r[k] for r in res[vmm] if r[k] is not None]
        return statistics.median(v) if v else None

    for vmm in [v for v in res if res[v]]:
        print(f"median {vmm}: host {fmt(med(vmm, 'host_ms'), 0)} ms, own {fmt(med(vmm, 'own_ms'), 0)} ms,"
              f" downtime {fmt(med(vmm, 'down_ms'))} ms, kept {fmt(med(vmm, 'kept'), 3)},"
              f" lost {fmt(med(vmm, 'lost_ms'), 0)} ms")
    k, q = med("kumo", "host_ms"), med("qemu", "host_ms")
    kk, qk = med("kumo", "kept"), med("qemu", "kept")
    kl, ql = med("kumo", "lost_ms"), med("qemu", "lost_ms")
    if k and q:
        print(f"host_total_ratio={fmt(k / q, 3)} kumo_kept={fmt(kk, 3)} qemu_kept={fmt(qk, 3)}"
              f" kumo_lost_ms={fmt(kl, 0)} qemu_lost_ms={fmt(ql, 0)}")


if __name__ == "__main__":
    main()
