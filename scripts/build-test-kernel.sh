#!/usr/bin/env bash
# Builds kumo's Linux test kernel: Linux 6.1 from Debian's linux-source-6.1 package, `make
# tinyconfig` plus scripts/linux/test-kernel.config, as an uncompressed ELF vmlinux booted
# through its PVH entry.
#
# The result is cached outside the work tree, keyed by the hash of the config fragment and of
# this script, so a machine builds it once:
#   $KUMO_KERNEL_CACHE/test-kernel-<key>/vmlinux      (default cache: ~/.cache/kumo/linux)
#   .../config, .../PACKAGE (source package and version), .../BUILD (build seconds)
#
# Usage: scripts/build-test-kernel.sh [--path|--force]
#   --path   print where the kernel is (or will be) and exit, building nothing
#   --force  build again even if the cache holds the kernel
# Prints the vmlinux path on stdout. Missing tools are installed with apt-get.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FRAGMENT="$REPO/scripts/linux/test-kernel.config"
CACHE="${KUMO_KERNEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kumo/linux}"
KEY="$(cat "$FRAGMENT" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
OUT="$CACHE/test-kernel-$KEY"
log() { echo "build-test-kernel: $*" >&2; }

case "${1:-}" in
    --path) echo "$OUT/vmlinux"; exit 0 ;;
    --force) rm -rf "$OUT" ;;
    "") ;;
    *) echo "usage: $0 [--path|--force]" >&2; exit 2 ;;
esac
if [ -s "$OUT/vmlinux" ]; then
    echo "$OUT/vmlinux"
    exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
for tool in gcc make flex bison bc xz perl; do
    command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
[ -f /usr/include/libelf.h ] || need+=(libelf-dev)
[ -f /usr/include/openssl/ssl.h ] || need+=(libssl-dev)
[ -f /usr/src/linux-source-6.1.tar.xz ] || need+=(linux-source-6.1)
if ((${#need[@]})); then
    need=("${need[@]/#xz/xz-utils}")
    log "installing ${need[*]}"
    $SUDO apt-get update -qq >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

start=$(date +%s)
work="$CACHE/build-$KEY"
rm -rf "$work"
mkdir -p "$work"
log "unpacking /usr/src/linux-source-6.1.tar.xz"
tar -C "$work" -xf /usr/src/linux-source-6.1.tar.xz
src="$work/linux-source-6.1"
make -C "$src" -s tinyconfig >&2
"$src/scripts/kconfig/merge_config.sh" -m -O "$src" "$src/.config" "$FRAGMENT" >&2
make -C "$src" -s olddefconfig >&2
# Every option the fragment asks for must have survived olddefconfig's dependency resolution.
missing=0
while IFS= read -r line; do
    case "$line" in
        CONFIG_*=*) grep -qxF "$line" "$src/.config" || { log "not in the final config: $line"; missing=1; } ;;
        "# CONFIG_"*" is not set") grep -qE "^${line:2:-11}=" "$src/.config" && { log "still set: ${line:2:-11}"; missing=1; } ;;
    esac
done <"$FRAGMENT"
[ "$missing" = 0 ] || { log "error: the config fragment does not apply (see above)"; exit 1; }
log "building vmlinux with $(nproc) jobs"
make -C "$src" -s -j"$(nproc)" vmlinux >&2
mkdir -p "$OUT.tmp"
cp "$src/vmlinux" "$OUT.tmp/vmlinux"
cp "$src/.config" "$OUT.tmp/config"
dpkg-query -W -f '${Package} ${Version}\n' linux-source-6.1 >"$OUT.tmp/PACKAGE"
echo "$(($(date +%s) - start))" >"$OUT.tmp/BUILD"
rm -rf "$OUT" "$work"
mv "$OUT.tmp" "$OUT"
log "built in $(cat "$OUT/BUILD") s: $OUT/vmlinux"
echo "$OUT/vmlinux"
