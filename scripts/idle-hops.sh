#!/bin/bash
# Idle migration throughput outside the bench: an idle memtouch guest, prefilled, hops N times
# over loopback TCP to destinations prepared with --memory, each hop right after a raw TCP run
# (Python, 1 GiB in 4 MiB writes, reno like kumo's loopback connections unless RAWCC says
# otherwise). Prints raw MB/s, the hop's total, MB/s, the ratio, pages and sender CPU, and the
# phases over 0.5 ms.
#
#   scripts/idle-hops.sh MEM N CONNECTIONS [KUMO]     e.g. scripts/idle-hops.sh 2G 3 2
set -euo pipefail
MEM=$1; N=$2; C=$3; K=${4:-target/release/kumo}
K=$(realpath "$K")
D=$(mktemp -d)
trap 'pkill -f "api-socket $D" || true; rm -rf "$D"' EXIT
cat > "$D/raw.py" <<'P'
import os, socket, sys, threading, time
N, B = 1 << 30, 4 << 20
ls = socket.socket(); ls.bind(('127.0.0.1', 0)); ls.listen(1)
def rx():
    c, _ = ls.accept(); mv = memoryview(bytearray(B)); got = 0
    while got < N:
        n = c.recv_into(mv)
        if not n: break
        got += n
t = threading.Thread(target=rx); t.start()
s = socket.socket()
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, os.environ.get('RAWCC', 'reno').encode())
s.connect(ls.getsockname()); data = b'\x01' * B
t0 = time.perf_counter(); sent = 0
while sent < N: s.sendall(data); sent += B
s.shutdown(socket.SHUT_WR); t.join()
print(f"{N / (time.perf_counter() - t0) / 1e6:.0f}")
P
"$K" run --guest memtouch --memory "$MEM" --api-socket "$D/a0.sock" pages=1000 writes=1000 prefill=1 hold_input=1 > "$D/src.log" 2>&1 &
for _ in $(seq 600); do grep -q "memtouch: checksum" "$D/src.log" && break; sleep 0.2; done
cur=$D/a0.sock
for i in $(seq "$N"); do
  port=$((20000 + RANDOM % 20000))
  "$K" run --incoming "tcp:127.0.0.1:$port" --memory "$MEM" --api-socket "$D/a$i.sock" > "$D/d$i.log" 2>&1 &
  for _ in $(seq 600); do grep -q "waiting for a migration" "$D/d$i.log" && break; sleep 0.1; done
  raw=$(python3 "$D/raw.py")
  "$K" --api-socket "$cur" migrate --to "tcp:127.0.0.1:$port" --connections "$C" --json > "$D/m$i.json" 2> "$D/m$i.err"
  python3 - "$D/m$i.json" "$raw" <<'P'
import json, sys
j = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); raw = float(sys.argv[2])
print(f"raw {raw:.0f} MB/s  total {j['total_ms']:.1f} ms  {j['mb_per_s']:.0f} MB/s  x{j['mb_per_s'] / raw:.2f}"
      f"  pages {j['total_pages']}  sender_cpu {j.get('sender_cpu_ms', 0):.0f} ms")
print('   ', ' '.join(f"{k[:-3]}={v:.1f}" for k, v in (j.get('phases') or {}).items() if v >= 0.5))
P
  cur=$D/a$i.sock
done
