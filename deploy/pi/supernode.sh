#!/bin/sh
# Starts this board's EdgeFleet SuperNode, by hand or as the edgefleet-supernode service.
# Everything lives beside this script (~/edgefleet on a Pi): venv/, ca.crt (the fleet's CA),
# node.key (this board's key, registered with `flwr supernode register`) and node.env:
#   SUPERLINK     the SuperLink's address as the board dials it, host:port
#   NODE_CONFIG   the --node-config string (device-id, data-path, keep-ratio, energy-source)
#   RUNTIME_PORT  the SuperNode's local Runtime API port (optional, default 9094)
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
set -a
. "$here/node.env"
set +a
# The SuperNode's ClientApp messages run in one warm process (worker.py, EdgeFleet's
# edgefleet/client/worker.py, with flower_private.py beside it: flwr and the standard library
# only). It runs
# `flower-supernode --isolation process` from the venv as its child and claims each message
# itself: a plain flower-supernode starts a new `flwr-clientapp` per message, which imports
# torch and rebuilds the device's data and model every round (deploy/EDGE.md, section 2).
PATH="$here/venv/bin:$PATH"
export PATH FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
exec "$here/venv/bin/python" "$here/worker.py" supernode \
    --superlink "$SUPERLINK" \
    --root-certificates "$here/ca.crt" \
    --auth-supernode-private-key "$here/node.key" \
    --port "${RUNTIME_PORT:-9094}" \
    --node-config "$NODE_CONFIG"
