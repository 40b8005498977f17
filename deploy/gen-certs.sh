#!/usr/bin/env bash
# Make a private CA and a SuperLink server certificate (and, with -n NODES, one SuperNode
# authentication key pair per node), for TLS between SuperNodes, the flwr CLI, the ServerApp
# executor and the SuperLink.
#
#   deploy/gen-certs.sh [-o DIR] [-n NODES] [-d DAYS] [-u UID] [-f] [LAN_ADDRESS ...]
#
#   -o DIR    output folder (default deploy/certs; created with mode 0700)
#   -n NODES  also make NODES SuperNode keys, keys/node-1 ... keys/node-NODES (ECDSA P-384,
#             OpenSSH format, as `flower-supernode --auth-supernode-private-key` and
#             `flwr supernode register` take them); 0 = none (default 0)
#   -d DAYS   validity of the CA and the server certificate (default 825)
#   -u UID    the user that reads the private keys server.key and keys/node-I (default 49999,
#             the containers' user `app`; give your own uid, `id -u`, for a bare
#             flower-superlink / flower-supernode run as you)
#   -f        overwrite an existing CA / certificate / keys (default: keep what is there)
#   LAN_ADDRESS  extra names the SuperLink is reached by: IPv4/IPv6 addresses go into the
#             certificate as IP SANs, anything else as DNS SANs (e.g. 192.168.1.20,
#             flower.example.lan)
#
# The certificate always covers the compose host names (superlink, edgefleet-superlink),
# localhost, 127.0.0.1 and ::1. Output:
#   DIR/ca.crt       give this to every SuperNode (--root-certificates) and to the flwr CLI
#                    (root-certificates = ... in ~/.flwr/config.toml)
#   DIR/ca.key       keep it private; only needed to sign a new server certificate
#   DIR/server.pem   SuperLink --ssl-certfile
#   DIR/server.key   SuperLink --ssl-keyfile
#   DIR/keys/node-I  SuperNode I's private key (give it to that node only)
#   DIR/pubkeys/node-I.pub  its public key, to register (`flwr supernode register`)
#
# Private keys (ca.key, server.key, keys/node-I) are mode 0600; server.key and the node keys
# belong to UID (as root; otherwise an ACL entry gives UID read access where setfacl exists,
# or a warning says who cannot read them), ca.key to you. Certificates and public keys are
# 0644. The folder is 0700: containers read their files through bind mounts.
set -euo pipefail

out="$(cd "$(dirname "$0")" && pwd)/certs"
nodes=0
days=825
force=""
reader=49999
while getopts "o:n:d:u:fh" opt; do
    case "$opt" in
        o) out="$OPTARG" ;;
        n) nodes="$OPTARG" ;;
        d) days="$OPTARG" ;;
        u) reader="$OPTARG" ;;
        f) force=1 ;;
        h) sed -n '2,37p' "$0"; exit 0 ;;
        *) sed -n '2,37p' "$0" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
command -v openssl >/dev/null || { echo "gen-certs: openssl not found" >&2; exit 1; }
[[ "$nodes" =~ ^[0-9]+$ ]] || { echo "gen-certs: -n needs a number, got '$nodes'" >&2; exit 2; }
[[ "$reader" =~ ^[0-9]+$ ]] || { echo "gen-certs: -u needs a numeric uid, got '$reader'" >&2; exit 2; }
umask 077

mkdir -p "$out"
chmod 0700 "$out"
cd "$out"

sans="DNS:superlink,DNS:edgefleet-superlink,DNS:localhost,IP:127.0.0.1,IP:::1"
for addr in "$@"; do
    if [[ "$addr" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$addr" == *:* ]]; then
        sans+=",IP:${addr}"
    elif [[ "$addr" =~ ^[A-Za-z0-9.-]+$ ]]; then
        sans+=",DNS:${addr}"
    else
        echo "gen-certs: '$addr' is neither an IP address nor a host name" >&2
        exit 2
    fi
done

if [[ -n "$force" || ! -f ca.crt || ! -f ca.key ]]; then
    openssl req -x509 -newkey rsa:4096 -sha256 -nodes -days "$days" \
        -keyout ca.key -out ca.crt -subj "/O=EdgeFleet/CN=EdgeFleet fleet CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    rm -f server.pem  # a new CA needs a new server certificate
    echo "gen-certs: new CA $out/ca.crt"
fi

# A server certificate is (re)made when missing, forced, or lacking one of the wanted names.
wanted_ok=1
if [[ -f server.pem ]]; then
    have="$(openssl x509 -in server.pem -noout -ext subjectAltName 2>/dev/null | tail -n +2 \
        | sed -e 's/IP Address:/IP:/g' -e 's/ //g')"
    IFS=',' read -r -a want <<<"$sans"
    for san in "${want[@]}"; do
        # openssl prints ::1 as 0:0:0:0:0:0:0:1
        [[ "$san" == "IP:::1" ]] && san="IP:0:0:0:0:0:0:0:1"
        [[ ",$have," == *",$san,"* ]] || wanted_ok=0
    done
fi
if [[ -n "$force" || ! -f server.pem || ! -f server.key || "$wanted_ok" == 0 ]]; then
    openssl req -newkey rsa:2048 -sha256 -nodes -keyout server.key -out server.csr \
        -subj "/O=EdgeFleet/CN=superlink" 2>/dev/null
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
        -out server.pem -days "$days" -sha256 \
        -extfile <(printf '%s\n' \
            "subjectAltName=${sans}" \
            "basicConstraints=CA:FALSE" \
            "keyUsage=critical,digitalSignature,keyEncipherment" \
            "extendedKeyUsage=serverAuth") 2>/dev/null
    rm -f server.csr
    echo "gen-certs: server certificate $out/server.pem for ${sans}"
fi
openssl verify -CAfile ca.crt server.pem >/dev/null

if [[ "$nodes" -gt 0 ]]; then
    command -v ssh-keygen >/dev/null || { echo "gen-certs: ssh-keygen not found (openssh-client)" >&2; exit 1; }
    mkdir -p keys pubkeys
    for i in $(seq 1 "$nodes"); do
        if [[ -n "$force" ]]; then rm -f "keys/node-$i" "keys/node-$i.pub" "pubkeys/node-$i.pub"; fi
        if [[ ! -f "keys/node-$i" ]]; then
            ssh-keygen -q -t ecdsa -b 384 -N "" -C "edgefleet-node-$i" -f "keys/node-$i"
        fi
        # The public key apart from the private ones: what registers keys mounts pubkeys/.
        if [[ -f "keys/node-$i.pub" ]]; then mv -f "keys/node-$i.pub" "pubkeys/node-$i.pub"; fi
    done
    echo "gen-certs: SuperNode keys $out/keys/node-{1..$nodes}, public keys $out/pubkeys/"
fi
chmod 0644 ca.crt server.pem
chmod 0600 ca.key server.key
readable=(server.key)
if [[ -d keys ]]; then
    chmod 0700 keys
    chmod 0600 keys/*
    readable+=(keys/*)
fi
if [[ -d pubkeys ]]; then chmod 0755 pubkeys; chmod 0644 pubkeys/*; fi
# The keys the SuperLink (and the proxies) and the SuperNodes read, for the user they run as.
if [[ "$(id -u)" == "$reader" ]]; then
    :
elif [[ "$(id -u)" == 0 ]]; then
    chown "$reader" "${readable[@]}"
    [[ -d keys ]] && chown "$reader" keys
elif command -v setfacl >/dev/null; then
    setfacl -m "u:${reader}:r" "${readable[@]}"
    [[ -d keys ]] && setfacl -m "u:${reader}:x" keys
else
    echo "gen-certs: warning: uid $reader cannot read ${readable[*]} (mode 0600, yours):" \
        "run as root, install acl (setfacl), or give -u your uid for processes run as you" >&2
fi
