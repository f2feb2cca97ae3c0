#!/usr/bin/env bash
# kumo demo: builds everything and shows the guests working, the control API, the start-up
# benchmark and, if a kernel can be fetched, Linux's first console lines on kumo's serial.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
cargo build --release --workspace
K=target/release/kumo
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

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

step "kumo bench boot --runs 10"
$K bench boot --runs 10 --out target/kumo-bench

if [ -e /dev/kvm ] && scripts/fetch-linux-kernel.sh >/dev/null 2>&1; then
    step "Linux (PVH vmlinux, Debian kernel): first console lines, 30 s of guest time"
    timeout 60 $K run --kernel .cache/linux/vmlinux --memory 512M --timeout 30 | head -20 || true
fi
