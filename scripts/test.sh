#!/usr/bin/env bash
# kumo's test command: installs what is missing, fetches the Debian kernel for the Linux boot
# test and builds kumo's Linux test kernel (once per machine: scripts/build-test-kernel.sh caches
# it outside the work tree, ~6 min on 2 cores) and libvirt's Cloud Hypervisor driver (the same,
# scripts/build-libvirt-ch.sh, ~2-4 min), then runs every test of the workspace. Tests that need
# /dev/kvm skip (with a message) where it is absent.
#
#   scripts/test.sh              every test
#   scripts/test.sh --e2e        only the end-to-end suites of VMs, the API and migration
#   KUMO_TEST_STRESS=1 scripts/test.sh [--e2e]
#                                the same with every core kept busy by an unrelated load (one
#                                spinning process per core, at normal priority): the suites
#                                must hold on a slower or busier machine.
# Further arguments go to the test binaries (e.g. a test name filter).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
e2e=0
if [ "${1:-}" = "--e2e" ]; then
    e2e=1
    shift
fi
scripts/setup.sh
if [ -e /dev/kvm ]; then
    if [ "$e2e" = 0 ]; then
        scripts/fetch-linux-kernel.sh >/dev/null
        scripts/build-test-kernel.sh >/dev/null
        scripts/build-libvirt-ch.sh >/dev/null
    fi
else
    echo "test: /dev/kvm absent: KVM tests will skip; not fetching a kernel" >&2
fi
cargo build --workspace --all-targets

stress=()
stop_stress() {
    if ((${#stress[@]})); then
        kill "${stress[@]}" 2>/dev/null || true
    fi
}
trap stop_stress EXIT
if [ "${KUMO_TEST_STRESS:-0}" = 1 ]; then
    for _ in $(seq "$(nproc)"); do
        bash -c 'while :; do :; done' &
        stress+=($!)
    done
    echo "test: KUMO_TEST_STRESS=1: ${#stress[@]} busy loops keep every core busy" >&2
fi

# A hung test must fail the run, not eat CI's whole time budget.
if [ "$e2e" = 1 ]; then
    timeout --signal=KILL 30m cargo test -p kumo-cli --test guests_e2e --test api_e2e --test openapi_e2e --test migration_e2e --test migration_tls_e2e --test snapshot_e2e --test net_e2e --test numa_e2e --test vhost_user_e2e --test handover_e2e --test irqchip_user_e2e --test elastic_e2e --test panic_e2e --test sandbox_e2e --test disk_e2e --test ch_api_e2e --test ch_client_e2e --test ch_net_fds_e2e -- --test-threads=2 "$@"
    timeout --signal=KILL 10m cargo test -p kumo-cli --test state_restore -- --test-threads=2 "$@"
else
    timeout --signal=KILL 60m cargo test --workspace -- --test-threads=2 "$@"
fi
