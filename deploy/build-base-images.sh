#!/usr/bin/env bash
# Build the Flower base images locally, for machines that cannot pull from Docker Hub.
#
#   deploy/build-base-images.sh            # builds only the tags that are missing
#   FORCE=1 deploy/build-base-images.sh    # rebuild all of them
#
# Result: flwr/superlink:$FLWR_VERSION, flwr/supernode:$FLWR_VERSION and
# flwr/superexec:$FLWR_VERSION (FLWR_VERSION from deploy/versions.env), built with the
# recipe of Flower's own Dockerfiles (src/docker/base, superlink, supernode, superexec in
# github.com/adap/flower): Python 3.11 with Flower installed into a virtual environment at
# /python/venv, a non-root user `app` (uid 49999) whose home and working directory is /app,
# PYTHONUNBUFFERED/PYTHONDONTWRITEBYTECODE/UTF-8 environment, and one image per entry point
# (flower-superlink, flower-supernode, flower-superexec). Two differences, both because
# nothing can be pulled here: the OS layer is a Debian minbase made with `debootstrap` and
# `docker import` (Flower's official images start from ubuntu:24.04 pulled from Docker Hub),
# and Python is Debian's python3.11 instead of one built with pyenv.
#
# If you can reach Docker Hub, just `docker pull flwr/superlink:$FLWR_VERSION` (etc.)
# instead; this script does nothing when the tags already exist.
#
# Needs: root (debootstrap, docker), debootstrap, a Debian mirror (MIRROR, default
# deb.debian.org) and PyPI reachable from inside `docker build` (for `pip install flwr`).
# The host's CA bundle is copied into the base so pip works behind a TLS-inspecting proxy.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck disable=SC1091
set -a; . "$HERE/versions.env"; set +a
FLWR_VERSION="${FLWR_VERSION:?}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
OS_IMAGE="flwr-local/debian:${SUITE}-python3"
BASE_IMAGE="flwr/base:${FLWR_VERSION}-py3.11-debian-${SUITE}-local"
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

have() { docker image inspect "$1" >/dev/null 2>&1; }
log() { printf '[build-base-images] %s\n' "$*" >&2; }

missing=()
for component in superlink supernode superexec; do
    if [[ -n "${FORCE:-}" ]] || ! have "flwr/${component}:${FLWR_VERSION}"; then
        missing+=("$component")
    fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
    log "flwr/{superlink,supernode,superexec}:${FLWR_VERSION} all present; nothing to do"
    exit 0
fi
log "to build: ${missing[*]} (${FLWR_VERSION})"

work="$(mktemp -d /tmp/flwr-base-images.XXXXXX)"
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

# 1. The OS layer: Debian minbase with Python 3.11, imported as an image.
if [[ -n "${FORCE:-}" ]] || ! have "$OS_IMAGE"; then
    command -v debootstrap >/dev/null || { log "debootstrap not found (apt-get install debootstrap)"; exit 1; }
    log "debootstrap ${SUITE} from ${MIRROR} (about a minute)"
    rootfs="$work/rootfs"
    debootstrap --variant=minbase \
        --include=python3,python3-venv,ca-certificates,libsqlite3-0 \
        "$SUITE" "$rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
        || { tail -30 "$work/debootstrap.log" >&2; exit 1; }
    if [[ -f "$CA_BUNDLE" ]]; then
        cp "$CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    fi
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/tmp/*
    log "docker import -> ${OS_IMAGE}"
    tar -C "$rootfs" --numeric-owner -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        - "$OS_IMAGE" >/dev/null
    rm -rf "$rootfs"
fi

# 2. Flower's base: venv with flwr, user app (uid 49999), /app (Flower's base/ubuntu recipe).
if [[ -n "${FORCE:-}" ]] || ! have "$BASE_IMAGE"; then
    log "building ${BASE_IMAGE}"
    docker build --pull=false -t "$BASE_IMAGE" \
        --build-arg "FLWR_VERSION=${FLWR_VERSION}" - <<DOCKERFILE
FROM ${OS_IMAGE}
ARG FLWR_VERSION
ENV DEBIAN_FRONTEND=noninteractive \\
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \\
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /python/venv \\
    && /python/venv/bin/python -m pip install -U --no-cache-dir pip setuptools "flwr==\${FLWR_VERSION}" \\
    && useradd --no-create-home --home-dir /app --uid 49999 --user-group --shell /bin/bash app \\
    && mkdir -p /app \\
    && chown -R app:app /app /python/venv
ENV PATH=/python/venv/bin:\$PATH \\
    PYTHONUNBUFFERED=1 \\
    PYTHONDONTWRITEBYTECODE=1 \\
    PYTHONIOENCODING=UTF-8 \\
    LANG=C.UTF-8 \\
    LC_ALL=C.UTF-8
WORKDIR /app
USER app
ENV HOME=/app
DOCKERFILE
fi

# 3. One image per entry point (Flower's superlink/supernode/superexec Dockerfiles).
for component in "${missing[@]}"; do
    log "building flwr/${component}:${FLWR_VERSION}"
    docker build --pull=false -t "flwr/${component}:${FLWR_VERSION}" - <<DOCKERFILE
FROM ${BASE_IMAGE}
ENTRYPOINT ["flower-${component}"]
DOCKERFILE
done
log "done: $(for c in superlink supernode superexec; do printf 'flwr/%s:%s ' "$c" "$FLWR_VERSION"; done)"
