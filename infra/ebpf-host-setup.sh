#!/usr/bin/env bash
# Prepare a host for the trainscope agent's eBPF collector (bcc). Idempotent: safe to re-run.
#
# What it does, and why:
#  1. installs Debian's bcc (bpfcc-tools, python3-bpfcc) — never the unrelated PyPI "bcc";
#  2. if the running kernel has no headers under /lib/modules/$(uname -r)/build, installs the
#     matching linux-headers-<release> package or, when none exists (custom/VM kernels), the
#     newest available linux-headers-*-cloud-amd64 package, and links
#     /lib/modules/$(uname -r)/build and .../source to that package's two directories
#     (bcc compiles its programs against them; uprobes and tracepoints only need a
#     compatible layout, not the exact release);
#  3. mounts tracefs and debugfs if they are missing (bcc attaches uprobes/tracepoints there);
#  4. makes the Debian bcc module importable from the project's Python (a pyenv/venv Python
#     cannot see Debian's dist-packages even with --system-site-packages): a .pth file in that
#     Python's site-packages points at a folder that links only `bcc`, so nothing else from the
#     system Python leaks in.
#
# Usage: sudo infra/ebpf-host-setup.sh [PYTHON]   (PYTHON defaults to `python3` on PATH, or
#        $TRAINSCOPE_PYTHON). Must run as root.
set -euo pipefail

log() { printf 'ebpf-host-setup: %s\n' "$*"; }
die() { printf 'ebpf-host-setup: error: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (installs packages, mounts tracefs)"

PYTHON=${1:-${TRAINSCOPE_PYTHON:-python3}}
RELEASE=$(uname -r)
MODDIR=/lib/modules/$RELEASE
export DEBIAN_FRONTEND=noninteractive

# --- 1. bcc -----------------------------------------------------------------------------------
need_install=()
for pkg in bpfcc-tools python3-bpfcc; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' \
        || need_install+=("$pkg")
done
updated=0
apt_update() { if [[ $updated -eq 0 ]]; then apt-get update -qq; updated=1; fi; }
if ((${#need_install[@]})); then
    apt_update
    log "installing ${need_install[*]}"
    apt-get install -y -qq --no-install-recommends "${need_install[@]}" >/dev/null
else
    log "bcc already installed"
fi

# --- 2. kernel headers ------------------------------------------------------------------------
if [[ -e $MODDIR/build/include/linux/kconfig.h || -e $MODDIR/build/Makefile ]] \
        && [[ -e $MODDIR/build/include/generated/autoconf.h ]]; then
    log "kernel headers for $RELEASE present at $MODDIR/build"
else
    apt_update
    if apt-cache show "linux-headers-$RELEASE" >/dev/null 2>&1; then
        pkg=linux-headers-$RELEASE
    else
        # No headers for this exact kernel (custom or VM kernel): take the newest cloud-amd64
        # headers package on offer. Version-sort so 6.12.x beats 6.1.x.
        pkg=$(apt-cache search --names-only '^linux-headers-[0-9].*-cloud-amd64$' \
              | awk '{print $1}' | sort -V | tail -n1)
        [[ -n $pkg ]] || die "no linux-headers package for $RELEASE and no *-cloud-amd64 fallback"
        log "no headers package for kernel $RELEASE; using $pkg"
    fi
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
        log "installing $pkg"
        apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null
    fi
    flavour_dir=/usr/src/${pkg}
    [[ -d $flavour_dir ]] || die "$pkg installed but $flavour_dir is missing"
    # The flavour package's Makefile includes the common tree; its path is the second directory.
    common_dir=$(sed -n 's/^include \(.*\)\/Makefile$/\1/p' "$flavour_dir/Makefile" | head -n1)
    if [[ -z $common_dir || ! -d $common_dir ]]; then
        common_dir=${flavour_dir%-cloud-amd64}-common
    fi
    [[ -d $common_dir ]] || die "cannot find the common headers directory of $pkg"
    mkdir -p "$MODDIR"
    ln -sfn "$flavour_dir" "$MODDIR/build"
    ln -sfn "$common_dir" "$MODDIR/source"
    log "linked $MODDIR/build -> $flavour_dir and $MODDIR/source -> $common_dir"
fi

# --- 3. tracefs / debugfs ---------------------------------------------------------------------
if ! mountpoint -q /sys/kernel/debug; then
    mount -t debugfs debugfs /sys/kernel/debug && log "mounted debugfs" \
        || log "warning: could not mount debugfs"
fi
if ! mountpoint -q /sys/kernel/tracing; then
    mount -t tracefs tracefs /sys/kernel/tracing && log "mounted tracefs" \
        || log "warning: could not mount tracefs at /sys/kernel/tracing"
fi
if [[ -d /sys/kernel/debug && ! -e /sys/kernel/debug/tracing/events ]]; then
    mount -t tracefs tracefs /sys/kernel/debug/tracing 2>/dev/null \
        && log "mounted tracefs under debugfs" || true
fi

# --- 4. bcc importable from the project's Python ----------------------------------------------
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    log "python '$PYTHON' not found; skipping the bcc import link"
    exit 0
fi
if "$PYTHON" -c 'import bcc' >/dev/null 2>&1; then
    log "bcc importable from $("$PYTHON" -c 'import sys; print(sys.executable)')"
    exit 0
fi
bcc_dir=$(/usr/bin/python3 -c 'import bcc, os; print(os.path.dirname(bcc.__file__))' 2>/dev/null) \
    || die "Debian python3 cannot import bcc after installing python3-bpfcc"
site_dir=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
link_root=/usr/local/lib/trainscope-bcc
mkdir -p "$link_root"
ln -sfn "$bcc_dir" "$link_root/bcc"
printf '%s\n' "$link_root" > "$site_dir/trainscope-bcc.pth"
"$PYTHON" -c 'import bcc' || die "bcc still not importable from $PYTHON"
log "bcc importable from $PYTHON via $site_dir/trainscope-bcc.pth"
