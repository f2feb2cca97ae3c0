#!/usr/bin/env bash
# Builds libvirt's unmodified Cloud Hypervisor (`ch`) driver, with virsh and libvirtd, from
# Debian 12's own libvirt 9.0.0 source package (Debian ships libvirt without that driver). Only
# what virsh and the ch driver need is enabled: the daemon, the remote driver, yajl and curl;
# every other hypervisor, storage and security driver is off.
#
# The result is installed into a cache outside the work tree, keyed by the hash of this script,
# so a machine builds it once:
#   $KUMO_LIBVIRT_CACHE/libvirt-ch-<key>/{bin/virsh,sbin/libvirtd,...}
#   .../PACKAGE (source package and version), .../BUILD (build seconds)
# (default cache: ~/.cache/kumo/libvirt)
#
# Usage: scripts/build-libvirt-ch.sh [--path|--force]
#   --path   print the install prefix and exit, building nothing
#   --force  build again even if the cache holds it
# Prints the install prefix on stdout. Missing tools and headers are installed with apt-get;
# the source comes from bookworm's deb-src (an apt source entry is added if none is there).
set -euo pipefail
VERSION=9.0.0
CACHE="${KUMO_LIBVIRT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kumo/libvirt}"
KEY="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
OUT="$CACHE/libvirt-ch-$KEY"
log() { echo "build-libvirt-ch: $*" >&2; }

case "${1:-}" in
    --path) echo "$OUT"; exit 0 ;;
    --force) rm -rf "$OUT" ;;
    "") ;;
    *) echo "usage: $0 [--path|--force]" >&2; exit 2 ;;
esac
# BUILD is written last: its presence says the install is whole.
if [ -s "$OUT/BUILD" ] && [ -x "$OUT/sbin/libvirtd" ] && [ -x "$OUT/bin/virsh" ]; then
    echo "$OUT"
    exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
pkgs=(meson ninja-build pkg-config gcc dpkg-dev xz-utils libxml2-dev libxml2-utils xsltproc
    libglib2.0-dev libgnutls28-dev libyajl-dev libcurl4-gnutls-dev libtirpc-dev python3-docutils
    libreadline-dev libnl-3-dev libnl-route-3-dev)
need=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
done
if ! grep -rqs "^Types:.*deb-src" /etc/apt/sources.list.d/ && ! grep -qs "^deb-src" /etc/apt/sources.list; then
    log "adding bookworm's deb-src to apt's sources"
    $SUDO tee /etc/apt/sources.list.d/kumo-deb-src.sources >/dev/null <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    updated=
else
    updated=1
fi
if ((${#need[@]})) || [ -z "$updated" ]; then
    $SUDO apt-get update -qq >&2
fi
if ((${#need[@]})); then
    log "installing ${need[*]}"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

start=$(date +%s)
work="$CACHE/build-$KEY"
rm -rf "$work"
mkdir -p "$work"
log "fetching Debian's libvirt $VERSION source"
(cd "$work" && apt-get source -qq --download-only "libvirt=$VERSION*" >&2 2>/dev/null ||
    apt-get source -qq --download-only libvirt >&2)
dsc=$(ls "$work"/libvirt_"$VERSION"*.dsc | head -1)
(cd "$work" && dpkg-source -x "$dsc" src >&2)
# Everything but the daemon, the remote driver and the ch driver is off.
off=(docs tests expensive_tests git_werror nls apparmor attr audit bash_completion blkid capng fuse
    glusterfs libiscsi libpcap libssh libssh2 netcf numactl openwsman pciaccess polkit sanlock
    sasl selinux udev wireshark_dissector driver_bhyve driver_esx driver_hyperv driver_interface
    driver_libxl driver_lxc driver_network driver_openvz driver_qemu driver_secrets driver_test
    driver_vbox driver_vmware driver_vz secdriver_apparmor apparmor_profiles secdriver_selinux
    storage_dir storage_disk storage_fs storage_gluster storage_iscsi storage_iscsi_direct
    storage_lvm storage_mpath storage_rbd storage_scsi storage_vstorage storage_zfs dtrace
    firewalld firewalld_zone host_validate login_shell nss numad pm_utils sysctl_config)
args=()
for o in "${off[@]}"; do args+=("-D$o=disabled"); done
log "configuring (ch driver, libvirtd, remote, virsh)"
meson setup "$work/build" "$work/src" --prefix="$OUT" -Ddriver_ch=enabled -Ddriver_libvirtd=enabled \
    -Ddriver_remote=enabled -Dcurl=enabled -Dyajl=enabled -Dreadline=enabled -Dlibnl=enabled \
    "${args[@]}" >&2
log "building with $(nproc) jobs"
ninja -C "$work/build" -j"$(nproc)" >&2
# The prefix is baked into the binaries (driver modules, state and socket directories), so it
# is installed in place; BUILD, written last, marks it whole.
rm -rf "$OUT"
ninja -C "$work/build" install >&2
echo "libvirt $(basename "$dsc" .dsc | sed 's/^libvirt_//')" >"$OUT/PACKAGE"
echo "$(($(date +%s) - start))" >"$OUT/BUILD"
rm -rf "$work"
log "built in $(cat "$OUT/BUILD") s: $OUT"
echo "$OUT"
