#!/usr/bin/env bash
# kumo demo: builds everything and shows the guests working, the control API, a live migration
# between two kumo processes, the start-up benchmark and, if a kernel can be fetched (its
# download's progress shown), Linux's first console lines on kumo's serial.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
[ "${1:-}" = "--debug" ] || cargo build --release --workspace
K=target/release/kumo
[ "${1:-}" = "--debug" ] && K=target/debug/kumo  # after `cargo build --workspace`
if [ -t 1 ]; then
    step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
else
    step() { printf '\n== %s\n' "$*"; }
fi

step "built guest programs"
$K guests
step "kumo run --guest hello"
$K run --guest hello; echo "exit code: $?"
step "kumo run --guest memtouch pages=20000 writes=200000 (random writes, checksum)"
$K run --guest memtouch --memory 256M pages=20000 writes=200000; echo "exit code: $?"
step "kumo run --guest smp --cpus 2 (IPI ping-pong between vCPU 0 and 1)"
$K run --guest smp --cpus 2; echo "exit code: $?"

step "control API: info / pause / resume / shutdown on a running VM"
sock=$(mktemp -u /tmp/kumo-demo-XXXX.sock)
$K run --guest memtouch pages=1000 duration_ms=600000 report_ms=1000 --api-socket "$sock" --timeout 120 &
vm=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
$K --api-socket "$sock" info
$K --api-socket "$sock" pause && echo "paused:" && $K --api-socket "$sock" info | grep state
sleep 1
$K --api-socket "$sock" resume && echo "resumed"
sleep 1.5
$K --api-socket "$sock" shutdown && echo "shutdown requested"
wait $vm; echo "VM exit code: $?"

step "live migration: a writing memtouch moves from one kumo process to another"
src_sock=$(mktemp -u /tmp/kumo-demo-src-XXXX.sock)
dst_sock=$(mktemp -u /tmp/kumo-demo-dst-XXXX.sock)
dst_out=$(mktemp /tmp/kumo-demo-dst-XXXX.out)
port=$((20000 + RANDOM % 20000))
# The destination waits for a VM; its console (stdout) goes to a file shown afterwards.
$K run --incoming "tcp:127.0.0.1:$port" --api-socket "$dst_sock" --timeout 120 >"$dst_out" &
dst=$!
# Random writes over 20,000 pages at 20,000/s, a progress line a second, until shut down.
$K run --guest memtouch --memory 256M pages=20000 rate=20000 duration_ms=600000 report_ms=1000 \
    --api-socket "$src_sock" --timeout 120 &
src=$!
for _ in $(seq 100); do [ -S "$src_sock" ] && break; sleep 0.05; done
sleep 1
$K --api-socket "$src_sock" migrate --to "tcp:127.0.0.1:$port"
wait $src; echo "source exit code: $? (the VM left this process)"
$K --api-socket "$dst_sock" info | grep -E '"(state|guest)"'
sleep 1.5
$K --api-socket "$dst_sock" shutdown
wait $dst; echo "destination exit code: $?; the guest's console there, after the migration:"
cat "$dst_out"; echo
rm -f "$dst_out"

step "kumo bench boot --runs 10"
$K bench boot --runs 10 --out target/kumo-bench

step "fetching a Debian cloud kernel (cached in .cache/linux after the first time)"
if [ -e /dev/kvm ] && scripts/fetch-linux-kernel.sh; then
    step "Linux (PVH vmlinux, Debian kernel): first console lines, 30 s of guest time"
    timeout 60 $K run --kernel .cache/linux/vmlinux --memory 512M --timeout 30 | head -20 || true
fi
