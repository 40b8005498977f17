#!/usr/bin/env bash
# Build every image docker-compose.yml needs, where it is missing:
#   1. flwr/{superlink,supernode,superexec}:$FLWR_VERSION with build-base-images.sh (a no-op
#      where they exist or were pulled);
#   2. the app image from deploy/Dockerfile (`docker-compose build`; cached after the first
#      time). A CPU torch wheel of $TORCH_VERSION found in $EDGEFLEET_TORCH_WHEEL_DIR,
#      $PIP_FIND_LINKS or pip's find-links setting is linked into deploy/wheels/ first, so the
#      image installs it instead of downloading torch.
# Needs a running Docker engine (and root plus debootstrap when the base images are missing).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/.."
log() { printf '[build-images] %s\n' "$*" >&2; }

bash "$HERE/build-base-images.sh"

# shellcheck disable=SC1091
set -a; . "$HERE/versions.env"; set +a
pattern="torch-${TORCH_VERSION:?}+cpu-cp311-*.whl"
if ! compgen -G "$HERE/wheels/$pattern" >/dev/null; then
    # shellcheck disable=SC2086  # folder lists are space-separated, as pip's are
    for dir in ${EDGEFLEET_TORCH_WHEEL_DIR:-} ${PIP_FIND_LINKS:-} \
        $(python3 -m pip config get global.find-links 2>/dev/null || true); do
        wheel="$(compgen -G "$dir/$pattern" | head -n 1 || true)"
        if [ -n "$wheel" ]; then
            ln "$wheel" "$HERE/wheels/" 2>/dev/null || cp "$wheel" "$HERE/wheels/"
            log "torch from $wheel"
            break
        fi
    done
fi

compose=(docker-compose)
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
fi
"${compose[@]}" --env-file "$HERE/versions.env" build
log "images ready"
