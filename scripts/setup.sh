#!/usr/bin/env bash
# Installs what building and testing kumo needs beyond the Rust toolchain: gcc and binutils
# (the guest programs are built with the host gcc and checked with objdump), and the tools the
# Linux kernel fetch uses, and QEMU. Idempotent; runs apt-get only when something is missing.
set -euo pipefail
need=()
command -v gcc >/dev/null 2>&1 || need+=(gcc)
command -v objdump >/dev/null 2>&1 || need+=(binutils)
command -v dpkg-deb >/dev/null 2>&1 || need+=(dpkg)
command -v xz >/dev/null 2>&1 || need+=(xz-utils)
command -v zstd >/dev/null 2>&1 || need+=(zstd)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# The network tests ping kumo's guests from the host.
command -v ping >/dev/null 2>&1 || need+=(iputils-ping)
# tests/sandbox_e2e.rs gives its unprivileged user access to /dev/kvm with an ACL entry.
command -v setfacl >/dev/null 2>&1 || need+=(acl)
# CI's shape checks (scripts/fn-lengths.py, scripts/module-cycles.py).
command -v python3 >/dev/null 2>&1 || need+=(python3)
# `kumo bench disk` measures the host's own I/O on its image with fio.
command -v fio >/dev/null 2>&1 || need+=(fio)
# `kumo bench migrate` draws its PNG with this font.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
if ((${#need[@]})); then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "setup: installing ${need[*]}" >&2
    $SUDO apt-get update -qq >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
fi
# QEMU runs kumo's guests for the comparison with QEMU's migration (tests/qemu_e2e.rs,
# crates/testkit/src/qemu.rs); without recommends it is the emulator and its firmware only.
if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "setup: installing qemu-system-x86" >&2
    # Not fatal: without QEMU its tests skip and the bench leaves out the comparison.
    if ! { $SUDO apt-get update -qq >&2 && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 >&2; }; then
        echo "setup: could not install qemu-system-x86; the QEMU tests will skip" >&2
    fi
fi
command -v cargo >/dev/null 2>&1 || { echo "setup: cargo not found: install Rust (rustup) first" >&2; exit 1; }
