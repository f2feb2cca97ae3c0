#!/usr/bin/env bash
# Fetch a Debian cloud kernel for kumo's Linux boot tests.
#
# Downloads linux-image-<abi>-cloud-amd64-unsigned from the Debian apt repositories, extracts it
# into a cache directory and leaves there:
#   vmlinuz   the bzImage (64-bit Linux boot protocol)
#   vmlinux   the uncompressed ELF kernel, extracted from the bzImage payload, only if the kernel
#             has CONFIG_PVH=y (it then carries the PVH entry ELF note)
#   config    the kernel's build configuration
#   PACKAGE   "<package> <version>" of what was fetched
#
# Usage: scripts/fetch-linux-kernel.sh [--force]
#   KUMO_CACHE          cache directory (default: <repo>/.cache/linux)
#   KUMO_LINUX_PACKAGE  exact package to fetch (default: the one the linux-image-cloud-amd64
#                       meta-package currently depends on, "-unsigned" variant)
#
# Idempotent: if the cache already holds a complete kernel it only prints the paths
# (pass --force to fetch again). Works as root on a fresh Debian 12 machine that can reach only
# the apt repositories; missing tools are installed with apt-get.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${KUMO_CACHE:-$REPO/.cache/linux}"
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done

log() { echo "fetch-linux-kernel: $*" >&2; }
die() { log "error: $*"; exit 1; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
fi

print_paths() {
    echo "package: $(cat "$CACHE/PACKAGE")"
    echo "vmlinuz: $CACHE/vmlinuz"
    if [ -f "$CACHE/vmlinux" ]; then
        echo "vmlinux: $CACHE/vmlinux"
    else
        echo "vmlinux: (none: kernel built without CONFIG_PVH)"
    fi
    echo "config:  $CACHE/config"
}

cache_complete() {
    [ -s "$CACHE/PACKAGE" ] && [ -s "$CACHE/vmlinuz" ] && [ -s "$CACHE/config" ] || return 1
    if grep -q '^CONFIG_PVH=y' "$CACHE/config"; then
        [ -s "$CACHE/vmlinux" ] || return 1
    fi
    return 0
}

if [ "$FORCE" -eq 0 ] && cache_complete; then
    log "kernel already cached in $CACHE"
    print_paths
    exit 0
fi

APT_UPDATED=0
apt_update() {
    if [ "$APT_UPDATED" -eq 0 ]; then
        log "running apt-get update"
        $SUDO apt-get update -qq >&2 || die "apt-get update failed"
        APT_UPDATED=1
    fi
}

# need_tool <command> <debian package>
need_tool() {
    command -v "$1" >/dev/null 2>&1 && return 0
    log "installing $2 (for $1)"
    if ! $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >&2; then
        apt_update
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >&2 \
            || die "cannot install $2"
    fi
}

need_tool apt-get apt
need_tool dpkg-deb dpkg
need_tool od coreutils
need_tool dd coreutils

# Pick the package: the meta-package's dependency, as the unsigned variant.
pick_package() {
    if [ -n "${KUMO_LINUX_PACKAGE:-}" ]; then
        echo "$KUMO_LINUX_PACKAGE"
        return 0
    fi
    local dep
    dep="$(apt-cache depends linux-image-cloud-amd64 2>/dev/null \
        | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-cloud-amd64\)$/\1/p' | head -n1)"
    if [ -n "$dep" ] && apt-cache show "$dep-unsigned" >/dev/null 2>&1; then
        echo "$dep-unsigned"
        return 0
    fi
    # Fall back to the newest unsigned cloud kernel apt knows about.
    apt-cache search --names-only '^linux-image-[0-9].*-cloud-amd64-unsigned$' 2>/dev/null \
        | awk '{print $1}' | sort -V | tail -n1
}

PKG="$(pick_package || true)"
if [ -z "$PKG" ] || ! apt-cache show "$PKG" >/dev/null 2>&1; then
    apt_update
    PKG="$(pick_package || true)"
fi
[ -n "$PKG" ] || die "no linux-image-*-cloud-amd64-unsigned package found in the apt sources"
VERSION="$(apt-cache show "$PKG" 2>/dev/null | sed -n 's/^Version: //p' | head -n1)"
[ -n "$VERSION" ] || die "apt does not know package $PKG"
log "using $PKG $VERSION"

mkdir -p "$CACHE"
WORK="$(mktemp -d "$CACHE/.work.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# apt-get download as root drops privileges to _apt, which must be able to write here.
chmod 0777 "$WORK"

DEB=""
if ls "$CACHE"/"${PKG}"_*.deb >/dev/null 2>&1; then
    DEB="$(ls "$CACHE"/"${PKG}"_*.deb | sort -V | tail -n1)"
    case "$DEB" in
        *"_${VERSION//:/%3a}_"*) log "reusing $DEB" ;;
        *) DEB="" ;;
    esac
fi
if [ -z "$DEB" ]; then
    SIZE="$(apt-cache show "$PKG=$VERSION" 2>/dev/null | sed -n 's/^Size: //p' | head -n1)"
    log "downloading $PKG=$VERSION${SIZE:+ ($((SIZE / 1000000)) MB)}"
    # apt's progress display on a terminal; quiet (one line per file) otherwise.
    QUIET=(-q)
    if [ -t 2 ]; then QUIET=(); fi
    if ! (cd "$WORK" && apt-get download "${QUIET[@]}" "$PKG=$VERSION" >&2); then
        apt_update
        (cd "$WORK" && apt-get download "${QUIET[@]}" "$PKG=$VERSION" >&2) || die "apt-get download $PKG failed"
    fi
    rm -f "$CACHE"/linux-image-*.deb
    DEB="$(ls "$WORK"/*.deb | head -n1)"
    mv "$DEB" "$CACHE/"
    DEB="$CACHE/$(basename "$DEB")"
fi

log "extracting $(basename "$DEB")"
mkdir -p "$WORK/pkg"
dpkg-deb --fsys-tarfile "$DEB" | tar -x -C "$WORK/pkg" --wildcards './boot/*' \
    || dpkg-deb -x "$DEB" "$WORK/pkg"
VMLINUZ="$(ls "$WORK"/pkg/boot/vmlinuz-* 2>/dev/null | head -n1)"
CONFIG="$(ls "$WORK"/pkg/boot/config-* 2>/dev/null | head -n1)"
[ -n "$VMLINUZ" ] || die "no boot/vmlinuz-* in $DEB"
[ -n "$CONFIG" ] || die "no boot/config-* in $DEB"

# Little-endian unsigned integer of <size> bytes at <offset> in <file>.
read_le() {
    od -An -t "u$3" -j "$2" -N "$3" --endian=little "$1" | tr -d ' \n'
}

# The bzImage must say "HdrS" at 0x202.
[ "$(dd if="$VMLINUZ" bs=1 skip=$((0x202)) count=4 status=none)" = "HdrS" ] \
    || die "$VMLINUZ is not a bzImage (no HdrS magic)"

extract_vmlinux() {
    local in="$1" out="$2"
    local setup_sects payload_offset payload_length start magic
    setup_sects="$(read_le "$in" $((0x1f1)) 1)"
    [ "$setup_sects" -eq 0 ] && setup_sects=4
    payload_offset="$(read_le "$in" $((0x248)) 4)"
    payload_length="$(read_le "$in" $((0x24c)) 4)"
    [ "$payload_length" -gt 0 ] || die "bzImage has no payload (boot protocol < 2.08?)"
    start=$(( (setup_sects + 1) * 512 + payload_offset ))
    log "payload: file offset $start, $payload_length bytes"
    dd if="$in" of="$WORK/payload" bs=4M iflag=skip_bytes,count_bytes \
        skip="$start" count="$payload_length" status=none
    magic="$(od -An -t x1 -N 6 "$WORK/payload" | tr -d ' \n')"
    # The kernel build appends the uncompressed size (4 bytes) after the stream; decompressors
    # that dislike trailing data may exit non-zero after writing everything, so the result is
    # judged by its ELF magic rather than the exit status.
    case "$magic" in
        fd377a585a00*) need_tool xz xz-utils;   xz -dc --single-stream <"$WORK/payload" >"$out" || true ;;
        28b52ffd*)     need_tool zstd zstd;     zstd -dcq <"$WORK/payload" >"$out" 2>/dev/null || true ;;
        1f8b*)         need_tool gzip gzip;     gzip -dc <"$WORK/payload" >"$out" 2>/dev/null || true ;;
        425a68*)       need_tool bzip2 bzip2;   bzip2 -dc <"$WORK/payload" >"$out" 2>/dev/null || true ;;
        5d0000*)       need_tool xz xz-utils;   xz -dc --format=lzma <"$WORK/payload" >"$out" 2>/dev/null || true ;;
        02214c18*)     need_tool lz4 lz4;       lz4 -dc <"$WORK/payload" >"$out" 2>/dev/null || true ;;
        894c5a4f*)     need_tool lzop lzop;     lzop -dc <"$WORK/payload" >"$out" 2>/dev/null || true ;;
        *) die "unknown bzImage payload compression (magic $magic)" ;;
    esac
    [ "$(od -An -t x1 -N 4 "$out" | tr -d ' \n')" = "7f454c46" ] \
        || die "decompressed payload is not an ELF file"
}

PVH=0
if grep -q '^CONFIG_PVH=y' "$CONFIG"; then
    PVH=1
    log "kernel has CONFIG_PVH=y: extracting vmlinux"
    extract_vmlinux "$VMLINUZ" "$WORK/vmlinux"
else
    log "kernel has no CONFIG_PVH: no vmlinux"
fi

# Install the results (each file replaced atomically).
cp "$VMLINUZ" "$CACHE/.vmlinuz.tmp" && mv "$CACHE/.vmlinuz.tmp" "$CACHE/vmlinuz"
cp "$CONFIG" "$CACHE/.config.tmp" && mv "$CACHE/.config.tmp" "$CACHE/config"
if [ "$PVH" -eq 1 ]; then
    mv "$WORK/vmlinux" "$CACHE/vmlinux"
else
    rm -f "$CACHE/vmlinux"
fi
echo "$PKG $VERSION" >"$CACHE/PACKAGE"
print_paths
