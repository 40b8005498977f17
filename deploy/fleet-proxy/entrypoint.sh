#!/bin/sh
# edgefleet-proxy fleet|control: nginx in front of the SuperLink (deploy/fleet-proxy/README in
# the Dockerfile). Writes its nginx.conf into /tmp (the root file system is read-only) from:
#   EDGEFLEET_SUPERLINK  the SuperLink as host:port (default edgefleet-superlink:8000)
#   EDGEFLEET_TLS_ARGS   set (by deploy/compose.tls.yml): listen with TLS on port 8000 with
#                        /app/certificates/server.{pem,key} and talk TLS to the SuperLink,
#                        verifying its certificate with /app/certificates/ca.crt; unset: plain
#                        HTTP both ways (the SuperLink runs --insecure then).
set -eu
role="${1:-}"
case "$role" in
    fleet | control) ;;
    *)
        echo "usage: edgefleet-proxy fleet|control (got '${role}')" >&2
        exit 2
        ;;
esac
upstream="${EDGEFLEET_SUPERLINK:-edgefleet-superlink:8000}"
upstream_name="${upstream%:*}"
certs=/app/certificates
if [ -n "${EDGEFLEET_TLS_ARGS:-}" ]; then
    listen="listen 8000 ssl;
        ssl_certificate ${certs}/server.pem;
        ssl_certificate_key ${certs}/server.key;
        ssl_protocols TLSv1.2 TLSv1.3;"
    upstream_tls="proxy_ssl_verify on;
        proxy_ssl_trusted_certificate ${certs}/ca.crt;
        proxy_ssl_verify_depth 2;
        proxy_ssl_server_name on;
        proxy_ssl_name ${upstream_name};"
    scheme=https
else
    listen="listen 8000;"
    upstream_tls=""
    scheme=http
fi
mkdir -p /tmp/nginx
cat >/tmp/nginx/nginx.conf <<CONF
pid /tmp/nginx/nginx.pid;
error_log stderr warn;
worker_processes 1;
events {
    worker_connections 1024;
}
http {
    # Refused and failed requests only: a device polls several times a minute.
    map \$status \$edgefleet_log {
        ~^[23] 0;
        default 1;
    }
    access_log /dev/stdout combined if=\$edgefleet_log;
    client_body_temp_path /tmp/nginx/body;
    proxy_temp_path /tmp/nginx/proxy;
    fastcgi_temp_path /tmp/nginx/fastcgi;
    uwsgi_temp_path /tmp/nginx/uwsgi;
    scgi_temp_path /tmp/nginx/scgi;
    server_tokens off;
    client_header_timeout 30s;
    client_body_timeout 60s;
    # Docker's DNS: the SuperLink's address is looked up again after a restart.
    resolver 127.0.0.11 valid=10s ipv6=off;
    server {
        ${listen}
        set \$edgefleet_superlink ${scheme}://${upstream};
        ${upstream_tls}
        include /etc/edgefleet/${role}-routes.conf;
    }
}
CONF
nginx -t -q -c /tmp/nginx/nginx.conf
echo "edgefleet-proxy: ${role} routes on :8000 ($([ "$scheme" = https ] && echo TLS || echo plain HTTP)) -> ${scheme}://${upstream}"
exec nginx -c /tmp/nginx/nginx.conf -g 'daemon off;'
