#!/usr/bin/env bash
# Installs what building and testing kumo needs beyond the Rust toolchain: gcc and binutils
# (the guest programs are built with the host gcc and checked with objdump), and the tools the
# Linux kernel fetch uses. Idempotent; runs apt-get only when something is missing.
set -euo pipefail
need=()
command -v gcc >/dev/null 2>&1 || need+=(gcc)
command -v objdump >/dev/null 2>&1 || need+=(binutils)
command -v dpkg-deb >/dev/null 2>&1 || need+=(dpkg)
command -v xz >/dev/null 2>&1 || need+=(xz-utils)
command -v zstd >/dev/null 2>&1 || need+=(zstd)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# `kumo bench migrate` draws its PNG with this font.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
if ((${#need[@]})); then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "setup: installing ${need[*]}" >&2
    $SUDO apt-get update -qq >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
fi
command -v cargo >/dev/null 2>&1 || { echo "setup: cargo not found: install Rust (rustup) first" >&2; exit 1; }
