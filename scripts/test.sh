#!/usr/bin/env bash
# kumo's test command: installs what is missing, fetches the Debian kernel for the Linux boot
# test, then runs every test of the workspace. Tests that need /dev/kvm skip (with a message)
# where it is absent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
if [ -e /dev/kvm ]; then
    scripts/fetch-linux-kernel.sh >/dev/null
else
    echo "test: /dev/kvm absent: KVM tests will skip; not fetching a kernel" >&2
fi
cargo build --workspace --all-targets
# A hung test must fail the run, not eat CI's whole time budget.
timeout --signal=KILL 45m cargo test --workspace -- --test-threads=2 "$@"
