#!/usr/bin/env bash
# An emulated Raspberry Pi on an x86-64 Linux machine: a Debian bookworm arm64 root file
# system (what Raspberry Pi OS 64-bit is built on; Python 3.11) run through qemu-user and
# binfmt_misc, with the Pi 4's or the Pi 5's CPU model. tests/test_arm64.py and
# .ci/arm64-prep use it to run deploy/EDGE.md's board steps as written; you can too:
#
#   deploy/emulated-pi.sh build                 # once: ~10 min for the root, ~10 for the venv
#   deploy/emulated-pi.sh run --board pi4 -- python3 -c 'import platform; print(platform.machine())'
#   deploy/emulated-pi.sh run --board pi5 --layer /tmp/board1 -- bash -l     # a shell on a "Pi 5"
#
# Commands:
#   setup    the host side (root): Debian's qemu-user-static and debootstrap;
#            binfmt_misc mounted and aarch64 ELF files handed to qemu (the entry and its
#            flags are described at binfmt_ready). Exit status 3: this host cannot emulate
#            (the last line says why).
#   build    setup, then the cached root: debootstrap (once), a user `pi` with sudo, then the
#            board steps of deploy/EDGE.md's <!-- board: install --> block as `pi` on the Pi 4's
#            CPU; again whenever that block or deploy/pi/ changes (only the venv part).
#   run      [--board pi4|pi5] [--layer DIR] [--bind HOST:BOARD]... [--env K=V]... -- CMD...
#            CMD as `pi` in /home/pi on the board. --layer DIR: the root is the lower layer of
#            an overlay whose upper layer is DIR/upper, so the cached root stays as built and
#            each board has its own files (keys, Flower state); without it CMD writes into
#            the cache. Everything is mounted in a mount namespace of the command's own, so
#            no mount outlives it, whatever ends it. --bind mounts a host path (read-write) at
#            a path on the board, e.g. a fake /sys/class/power_supply.
#   node-bin DIR [--board pi4|pi5]
#            write DIR/python and DIR/flower-supernode that run the board's own (default
#            pi5), for `benchmarks/perf/deploy_overhead.py --node-bin DIR`: /tmp and /work are the
#            same paths on the board, the benchmark's variables are passed on, and the
#            folders the benchmark (root) made for the node are opened to the board's user
#   path     print the root's path;  stamp  print the hash the venv was built from
#   clean    delete the cache
#
# Emulation facts (qemu 7.2 on Debian bookworm; each cost time to find):
# - QEMU_CPU is always set: the default `max` enables SVE and made an SGD step 6x slower, and
#   the boards differ exactly there (cortex-a72 = Pi 4, ARMv8.0; cortex-a76 = Pi 5, ARMv8.2).
# - qemu-user shows the host's x86 /proc/cpuinfo, which crashed torch 2.13 at start-up: each
#   board gets a /proc/cpuinfo of its own CPU bound over it.
# - pip on the board verifies TLS with the host's CA bundle (this host's registries may be
#   behind a proxy with its own CA); the board's /etc/pip.conf names it. Commands start from
#   `env -i`, so none of the host's pip settings (local x86 wheel folders) leak in.
# - The cache lives outside the repository: $EDGEFLEET_ARM64_CACHE, default
#   ${XDG_CACHE_HOME:-~/.cache}/edgefleet/arm64 (about 2 GB).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
EDGE_MD="$HERE/EDGE.md"
PI_DIR="$HERE/pi"
CACHE="${EDGEFLEET_ARM64_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgefleet/arm64}"
ROOT="$CACHE/root"
SUITE=bookworm
MIRROR="${EDGEFLEET_ARM64_MIRROR:-http://deb.debian.org/debian}"
# What Raspberry Pi OS Lite has and minbase lacks: sudo, certificates, ssh-keygen.
INCLUDE=python3,sudo,ca-certificates,openssh-client
BASE_STAMP="$ROOT/etc/edgefleet-base"
BASE_ID="debootstrap --arch=arm64 --variant=minbase --include=$INCLUDE $SUITE; user pi"
VENV_STAMP="$ROOT/home/pi/edgefleet/.installed"

log() { printf '[emulated-pi %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "$*"; exit 1; }
cannot() { log "cannot emulate here: $*"; exit 3; }

# -- the host -------------------------------------------------------------------------------

# binfmt_misc entry of our own for aarch64 ELF files: qemu-aarch64-static with the flags
# P (argv[0] kept), O and C (credentials from the binary: without them a setuid binary such
# as the board's sudo cannot become root, and EDGE.md's `sudo apt-get` fails) and F (the
# interpreter opened now, so a chroot needs no qemu inside). Debian registers its
# qemu-aarch64 entry without C on purpose (a setuid binary runs under qemu as root); on a
# machine used as root anyway that does not matter. Debian's entry is disabled while ours
# is there, so that ours is the one used.
BINFMT=/proc/sys/fs/binfmt_misc
ENTRY=edgefleet-aarch64
ELF_MAGIC='\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
ELF_MASK='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
QEMU=/usr/libexec/qemu-binfmt/aarch64-binfmt-P

binfmt_ready() {
    local entry="$BINFMT/$ENTRY"
    [ -r "$entry" ] && grep -qx enabled "$entry" && grep -q '^flags: POCF$' "$entry" &&
        ! grep -qsx enabled "$BINFMT/qemu-aarch64"
}

setup() {
    [ "$(uname -s)" = Linux ] || cannot "not Linux"
    [ "$(uname -m)" = x86_64 ] || cannot "the host is $(uname -m); this script emulates arm64 on x86-64"
    [ "$(id -u)" = 0 ] || cannot "needs root (debootstrap, chroot, mounts)"
    local need=()
    command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
    command -v debootstrap >/dev/null || need+=(debootstrap)
    if ((${#need[@]})); then
        command -v apt-get >/dev/null || cannot "needs ${need[*]} and there is no apt-get"
        log "apt-get install ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        # CI's other preparation (.ci/docker-prep) may hold apt's locks: wait for them.
        local try lock=(-o DPkg::Lock::Timeout=300)
        for try in 1 2 3 4 5; do
            apt-get "${lock[@]}" update -qq >/dev/null 2>&1 &&
                apt-get "${lock[@]}" install -y -qq "${need[@]}" >/dev/null && break
            ((try < 5)) || cannot "apt-get install ${need[*]} failed"
            sleep 20
        done
    fi
    if ! binfmt_ready; then
        if [ ! -e "$BINFMT/register" ]; then
            mount binfmt_misc -t binfmt_misc "$BINFMT" 2>/dev/null ||
                cannot "binfmt_misc cannot be mounted (a container without that privilege?)"
        fi
        [ -x "$QEMU" ] || cannot "$QEMU is missing (Debian's qemu-user-static >= 7.2 has it)"
        [ -e "$BINFMT/$ENTRY" ] && echo -1 >"$BINFMT/$ENTRY"
        echo ":$ENTRY:M:0:$ELF_MAGIC:$ELF_MASK:$QEMU:POCF" >"$BINFMT/register" 2>/dev/null ||
            cannot "registering $ENTRY with binfmt_misc failed"
        if grep -qsx enabled "$BINFMT/qemu-aarch64"; then
            echo 0 >"$BINFMT/qemu-aarch64"
        fi
        binfmt_ready || cannot "the $ENTRY binfmt_misc entry is not active after registering it"
    fi
    command -v unshare >/dev/null || cannot "needs unshare (util-linux)"
    unshare --mount true 2>/dev/null || cannot "cannot make a mount namespace (unshare --mount)"
}

# -- the root -------------------------------------------------------------------------------

# The text of the fenced block that follows `<!-- board: NAME -->` in EDGE.md.
doc_block() {
    awk -v mark="<!-- board: $1 -->" '
        index($0, mark) == 1 { found = 1; next }
        found && !inside && /^```/ { inside = 1; next }
        inside && /^```/ { exit }
        inside { print }' "$EDGE_MD"
}

venv_hash() {
    { doc_block install; cat "$PI_DIR"/requirements*.txt "$PI_DIR"/check-torch.py; } |
        sha256sum | cut -c1-16
}

build_base() {
    if [ -f "$BASE_STAMP" ] && [ "$(cat "$BASE_STAMP")" = "$BASE_ID" ]; then
        return
    fi
    local tmp="$CACHE/root.tmp"
    mkdir -p "$CACHE"
    rm -rf --one-file-system "$tmp" "$ROOT"
    log "debootstrap $SUITE arm64 into $tmp (8-15 minutes under emulation)"
    # In a mount namespace of its own: the /proc it mounts in the target cannot outlive it.
    unshare --mount --propagation private \
        debootstrap --arch=arm64 --variant=minbase --include="$INCLUDE" "$SUITE" "$tmp" "$MIRROR" \
        >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed"; }
    # The host's package sources and apt settings (same mirror, same trust settings).
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        cp /etc/apt/sources.list.d/debian.sources "$tmp/etc/apt/sources.list.d/"
        : >"$tmp/etc/apt/sources.list"
    fi
    cp /etc/apt/apt.conf.d/99* "$tmp/etc/apt/apt.conf.d/" 2>/dev/null || true
    chroot "$tmp" /usr/sbin/useradd --create-home --shell /bin/bash --uid 1000 \
        --groups sudo pi
    echo 'pi ALL=(ALL) NOPASSWD: ALL' >"$tmp/etc/sudoers.d/010_pi-nopasswd"
    # sudo looks its host name up; each board's (run) resolves without a name server.
    echo '127.0.1.1 pi4-emulated pi5-emulated' >>"$tmp/etc/hosts"
    chmod 440 "$tmp/etc/sudoers.d/010_pi-nopasswd"
    echo "$BASE_ID" >"$tmp/etc/edgefleet-base"
    mv "$tmp" "$ROOT"
    log "root ready: $ROOT ($(du -sh "$ROOT" | cut -f1))"
}

host_files() {
    # TLS through this host's proxy, if any, and its name servers.
    local bundle="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
    if [ -f "$bundle" ]; then
        cp "$bundle" "$ROOT/etc/ssl/certs/host-ca-bundle.pem"
        printf '[global]\ncert = /etc/ssl/certs/host-ca-bundle.pem\n' >"$ROOT/etc/pip.conf"
    fi
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
}

build_venv() {
    local want
    want="$(venv_hash)"
    if [ -f "$VENV_STAMP" ] && [ "$(cat "$VENV_STAMP")" = "$want" ]; then
        log "venv up to date ($want): $ROOT/home/pi/edgefleet/venv"
        return
    fi
    local block
    block="$(doc_block install)"
    [ -n "$block" ] || die "no <!-- board: install --> block in $EDGE_MD"
    log "board install steps (EDGE.md) as pi, Pi 4 CPU; log: $CACHE/install.log"
    rm -rf --one-file-system "$ROOT/home/pi/edgefleet"
    # What the operator's `scp -r deploy/pi pi@board:edgefleet` puts on the board (scp
    # follows the worker.py link; so must cp).
    cp -rL "$PI_DIR" "$ROOT/home/pi/edgefleet"
    chown -R 1000:1000 "$ROOT/home/pi/edgefleet"
    local t0=$SECONDS
    run_cmd --board pi4 -- bash -euo pipefail -c "$block" >"$CACHE/install.log" 2>&1 ||
        { tail -30 "$CACHE/install.log" >&2; die "the board install steps failed"; }
    tail -1 "$CACHE/install.log" >&2
    echo "$want" >"$VENV_STAMP"
    log "venv built in $((SECONDS - t0)) s: $(du -sh "$ROOT/home/pi/edgefleet/venv" | cut -f1)"
}

build() {
    setup
    build_base
    host_files
    build_venv
}

# -- running on the board -------------------------------------------------------------------

cpuinfo() {
    # What Raspberry Pi OS shows for the board's cores (4 of them).
    local features part variant revision model
    case "$1" in
    pi4)
        features="fp asimd evtstrm crc32 cpuid" part=0xd08 variant=0x0 revision=3
        model="Raspberry Pi 4 Model B Rev 1.4"
        ;;
    pi5)
        features="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
        part=0xd0b variant=0x4 revision=1 model="Raspberry Pi 5 Model B Rev 1.0"
        ;;
    esac
    for i in 0 1 2 3; do
        printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: %s\n' "$i" "$features"
        printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: %s\n' "$variant"
        printf 'CPU part\t: %s\nCPU revision\t: %s\n\n' "$part" "$revision"
    done
    printf 'Model\t\t: %s\n' "$model"
}

# A /sys for the board: qemu-user has none of its own, and torch's CPU probe (cpuinfo, oneDNN)
# reads the processor lists and each core's MIDR_EL1 from it (without them NNPACK is not
# initialised, so convolutions take other code paths than on the real board). An empty
# class/power_supply is the mount point for a fake battery (--bind).
fake_sysfs() {
    local board="$1" dir="$CACHE/sys-$1" midr
    case "$board" in
    pi4) midr=0x00000000410fd083 ;; # Cortex-A72 r0p3
    pi5) midr=0x00000000414fd0b1 ;; # Cortex-A76 r4p1
    esac
    if [ ! -f "$dir/devices/system/cpu/cpu3/regs/identification/midr_el1" ]; then
        rm -rf "$dir.$$"
        mkdir -p "$dir.$$/class/power_supply" "$dir.$$/devices/system/cpu"
        for f in possible present online; do echo 0-3 >"$dir.$$/devices/system/cpu/$f"; done
        for i in 0 1 2 3; do
            mkdir -p "$dir.$$/devices/system/cpu/cpu$i/regs/identification" \
                "$dir.$$/devices/system/cpu/cpu$i/topology"
            echo "$midr" >"$dir.$$/devices/system/cpu/cpu$i/regs/identification/midr_el1"
            echo 0 >"$dir.$$/devices/system/cpu/cpu$i/topology/physical_package_id"
            echo 0-3 >"$dir.$$/devices/system/cpu/cpu$i/topology/core_siblings_list"
            echo "$i" >"$dir.$$/devices/system/cpu/cpu$i/topology/thread_siblings_list"
        done
        mv -T "$dir.$$" "$dir" 2>/dev/null || rm -rf "$dir.$$"  # another run made it first
    fi
    echo "$dir"
}

run_cmd() {
    local board=pi4 layer="" binds=() envs=()
    while (($#)); do
        case "$1" in
        --board) board="$2"; shift 2 ;;
        --layer) layer="$2"; shift 2 ;;
        --bind) binds+=("$2"); shift 2 ;;
        --env) envs+=("$2"); shift 2 ;;
        --) shift; break ;;
        *) die "run: unknown option $1 (valid: --board, --layer, --bind, --env, then -- CMD)" ;;
        esac
    done
    (($#)) || die "run: no command (run [options] -- CMD...)"
    local cpu
    case "$board" in
    pi4) cpu=cortex-a72 ;;
    pi5) cpu=cortex-a76 ;;
    *) die "run: --board $board is unknown; valid: pi4 (cortex-a72), pi5 (cortex-a76)" ;;
    esac
    [ -f "$BASE_STAMP" ] || die "no root at $ROOT: run '$0 build' first"
    binfmt_ready || die "aarch64 is not handed to qemu (binfmt_misc $ENTRY): run '$0 setup'"
    local top="$ROOT"
    if [ -n "$layer" ]; then
        mkdir -p "$layer/upper" "$layer/work" "$layer/merged"
        top="$(cd "$layer" && pwd)/merged"
    fi
    local info="$CACHE/cpuinfo-$board" sys
    cpuinfo "$board" >"$info.$$" && mv "$info.$$" "$info"
    sys="$(fake_sysfs "$board")"
    # The namespace's own hostname too: the board's `hostname` says which board it is.
    local script='
        set -e
        root="$1" top="$2" layer="$3" info="$4" board="$5" sys="$6"; shift 6
        if [ -n "$layer" ]; then
            mount -t overlay overlay \
                -o "lowerdir=$root,upperdir=$layer/upper,workdir=$layer/work" "$top"
        fi
        mount -t proc proc "$top/proc"
        mount --bind "$info" "$top/proc/cpuinfo"
        mount --bind "$sys" "$top/sys"
        mount -t tmpfs -o mode=1777 tmpfs "$top/dev/shm"
        while [ "$1" != "--" ]; do
            mkdir -p "$top${1#*:}"
            mount --bind "${1%%:*}" "$top${1#*:}"
            shift
        done
        shift
        hostname "$board-emulated"
        exec chroot --userspec=1000:1000 --groups=27 "$top" "$@"'
    unshare --mount --uts --propagation private -- bash -c "$script" emulated-pi \
        "$ROOT" "$top" "$layer" "$info" "$board" "$sys" "${binds[@]}" -- \
        /usr/bin/env -i -C /home/pi HOME=/home/pi USER=pi LOGNAME=pi SHELL=/bin/bash \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
        QEMU_CPU="$cpu" "${envs[@]}" "$@"
}

node_bin() {
    local dir="${1:-}" board=pi5 name
    [ -n "$dir" ] || die "node-bin: no folder (node-bin DIR [--board pi4|pi5])"
    if [ "${2:-}" = --board ]; then board="${3:-}"; fi
    case "$board" in
    pi4 | pi5) ;;
    *) die "node-bin: --board $board is unknown; valid: pi4, pi5" ;;
    esac
    mkdir -p "$dir"
    for name in python flower-supernode; do
        # Expanded now: $board, $name, $HERE; everything escaped runs when the wrapper does.
        cat >"$dir/$name" <<EOF
#!/usr/bin/env bash
# The emulated $board's $name (written by deploy/emulated-pi.sh node-bin).
set -euo pipefail
envs=(--env PATH=/home/pi/edgefleet/venv/bin:/usr/bin:/bin)
for v in PYTHONPATH FLWR_HOME EDGEFLEET_DEPLOY_TRACE EDGEFLEET_FLEET_TAG \\
    FLWR_SUPEREXEC_TASK_POLL_INTERVAL FLWR_TELEMETRY_ENABLED FLWR_DISABLE_UPDATE_CHECK \\
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION; do
    if [ -n "\${!v:-}" ]; then envs+=(--env "\$v=\${!v}"); fi
done
# The board's user (pi) must reach the folders the benchmark (root) made for the node.
open_up() {
    local d="\$1"
    while [ -n "\$d" ] && [ "\$d" != / ] && [ "\$d" != /tmp ]; do
        chmod o+rwx "\$d" 2>/dev/null || true
        d="\$(dirname "\$d")"
    done
}
if [ -n "\${FLWR_HOME:-}" ]; then
    mkdir -p "\$FLWR_HOME" && chmod -R a+rwX "\$FLWR_HOME" && open_up "\$FLWR_HOME"
fi
if [ -n "\${EDGEFLEET_DEPLOY_TRACE:-}" ]; then
    touch "\$EDGEFLEET_DEPLOY_TRACE" && chmod a+rw "\$EDGEFLEET_DEPLOY_TRACE"
    open_up "\$(dirname "\$EDGEFLEET_DEPLOY_TRACE")"
fi
IFS=: read -ra paths <<<"\${PYTHONPATH:-}"
for p in "\${paths[@]}"; do if [ -d "\$p" ]; then open_up "\$p"; fi; done
exec bash "$HERE/emulated-pi.sh" run --board $board --bind /tmp:/tmp --bind /work:/work \\
    "\${envs[@]}" -- /home/pi/edgefleet/venv/bin/$name "\$@"
EOF
        chmod +x "$dir/$name"
    done
    log "wrote $dir/python and $dir/flower-supernode ($board)"
}

case "${1:-}" in
setup) setup ;;
node-bin) shift; node_bin "$@" ;;
build) build ;;
run) shift; run_cmd "$@" ;;  # its exit status is the command's
path) echo "$ROOT" ;;
stamp) cat "$VENV_STAMP" 2>/dev/null || echo none ;;
hash) venv_hash ;;
clean) rm -rf --one-file-system "$CACHE" ;;
*) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
