#!/bin/bash
# Host -> netecho round trips outside the bench, for A/B runs of kumo builds: a tap in a
# namespace of its own (kn/kt0, 10.0.0.1/24), one kumo VM at a time (1 vCPU, 256 MiB, netecho
# at 10.0.0.2, irq=direct), `kumo-bench net-tool rtt` from the host side, builds alternating
# round by round. MODE pin: once the guest is up, vCPU 0 goes to host CPU 1 and every other
# thread of the VMM to CPU 0; free: nothing is pinned. Needs root and /dev/kvm.
#
#   scripts/net-rtt.sh pin|free ROUNDS COUNT KUMO... e.g. scripts/net-rtt.sh free 6 10000 /tmp/old /tmp/new
#   TRACE=1 scripts/net-rtt.sh free 1 5000 target/release/kumo   (ftrace of the run, then
#                                         scripts/net-rtt-placement.py reads /tmp/net-rtt.trace)
set -euo pipefail
MODE=$1; ROUNDS=$2; COUNT=$3; shift 3
BENCH=${KUMO_BENCH:-target/release/kumo-bench}
T=/sys/kernel/tracing
EV="sched/sched_wakeup sched/sched_switch sched/sched_migrate_task kvm/kvm_msi_set_irq kvm/kvm_mmio"
ip netns del kn 2>/dev/null || true
ip netns add kn
ip netns exec kn ip link set lo up
ip netns exec kn ip tuntap add kt0 mode tap
ip netns exec kn ip addr add 10.0.0.1/24 dev kt0
ip netns exec kn ip link set kt0 up
LOG=$(mktemp)
trap 'ip netns del kn 2>/dev/null || true; rm -f "$LOG"' EXIT
for _ in $(seq "$ROUNDS"); do
  for kumo in "$@"; do
    ip netns exec kn "$kumo" run --memory 256M --guest netecho --cpus 1 --timeout 600 \
      --net tap=kt0,mac=52:54:00:12:34:56,irq=direct -- ip=10.0.0.2 wait=irq > "$LOG" 2>&1 &
    vm=$!
    for _ in $(seq 100); do grep -q "netecho: up" "$LOG" && break; sleep 0.1; done
    if [ "$MODE" = pin ]; then
      for t in /proc/$vm/task/*; do
        if [ "$(cat "$t/comm")" = vcpu0 ]; then taskset -pc 1 "${t##*/}" >/dev/null; else taskset -pc 0 "${t##*/}" >/dev/null; fi
      done
    fi
    if [ "${TRACE:-0}" = 1 ]; then
      echo 0 > $T/tracing_on; echo > $T/trace; echo 65536 > $T/buffer_size_kb
      for e in $EV; do echo 1 > "$T/events/$e/enable"; done
      echo 1 > $T/tracing_on
    fi
    out=$(ip netns exec kn "$BENCH" net-tool rtt --to 10.0.0.2:7 --count "$COUNT" --size 64)
    if [ "${TRACE:-0}" = 1 ]; then
      echo 0 > $T/tracing_on
      for e in $EV; do echo 0 > "$T/events/$e/enable"; done
      cat $T/trace > /tmp/net-rtt.trace
    fi
    echo "$kumo $out"
    kill $vm; wait $vm 2>/dev/null || true
  done
done
