#!/bin/sh
# Prometheus of the compose demo. The dashboard's token comes from the environment
# (EDGEFLEET_DASHBOARD_TOKEN, as the dashboard's does) into a file only this user can read,
# which prometheus.yml names: Prometheus reads credentials from a file, not from a variable.
# Extra arguments go to prometheus (e.g. --storage.tsdb.retention.time=2d).
set -eu
if [ -z "${EDGEFLEET_DASHBOARD_TOKEN:-}" ]; then
    echo "edgefleet-prometheus: set EDGEFLEET_DASHBOARD_TOKEN (the dashboard's token) to scrape its /metrics" >&2
    exit 2
fi
umask 077
printf '%s' "$EDGEFLEET_DASHBOARD_TOKEN" >/tmp/dashboard-token
exec prometheus \
    --config.file=/etc/edgefleet/prometheus.yml \
    --storage.tsdb.path=/var/lib/prometheus/metrics2 \
    --web.listen-address=0.0.0.0:9090 \
    "$@"
