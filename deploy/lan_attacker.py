"""A host on the fleet's LAN that holds the public ``ca.crt`` and tries to run the fleet.

    python lan_attacker.py --ca CA --app APP_DIR --pubkey KEY.pub --run-id ID \
        --fleet HOST:PORT [--closed HOST:PORT ...]

Through the address the devices dial (``--fleet``) it tries, as Flower's own tools do it,
what the SuperLink's Control and Runtime APIs would let an unauthenticated caller do:
``flwr run`` (its code would run in the ServerApp and every ClientApp executor), ``flwr
supernode register`` (its own node key, past node authentication), ``flwr stop`` of the
fleet's run, and a Runtime task claim (``runtime_claim.py``, next to this file). It also asks
for the fleet proxy's ``/nginx-health`` over TLS, so that a refusal is known to come from the
fleet's side and not from a broken path or a certificate mismatch. Every ``--closed`` address
(the host's Control port, the SuperLink container's own addresses) gets a TCP connection
attempt: nothing there should accept one from the LAN. Prints one JSON object: per attempt,
``ok`` (the attempt succeeded) and what came back.

tests/test_compose.py runs it in a container on a network of its own (as a LAN host: it
reaches only what the Docker host publishes on its addresses), with ``superlink`` resolving
to the Docker host, the name the server certificate carries.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _flwr(home: Path, *args: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    try:
        proc = subprocess.run(
            ["flwr", *args, "--format", "json"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "said": "timed out after 120 s"}
    out = proc.stdout
    start = out.find("{")
    try:
        data = json.loads(out[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        data = {}
    said = data.get("error-message") or (out + proc.stderr)[-400:]
    return {"ok": data.get("success") is True, "said": str(said)[:400]}


def _health(address: str, ca: str) -> dict[str, Any]:
    ctx = ssl.create_default_context(cafile=ca)
    try:
        with urllib.request.urlopen(
            f"https://{address}/nginx-health", timeout=15, context=ctx
        ) as r:
            return {"ok": r.status == 200, "said": f"HTTP {r.status}"}
    except Exception as e:  # noqa: BLE001 - the failure is the answer
        return {"ok": False, "said": f"{type(e).__name__}: {str(e)[:300]}"}


def _claim(address: str, ca: str) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from runtime_claim import claim

    answer = claim(address, ca, None)
    return {"ok": answer.get("claimed") is True, "said": str(answer)[:400]}


def _connect(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return {"ok": True, "said": "connected"}
    except OSError as e:
        return {"ok": False, "said": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ca", required=True)
    parser.add_argument("--app", required=True)
    parser.add_argument("--pubkey", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--fleet", required=True, help="what the devices dial")
    parser.add_argument("--closed", action="append", default=[], help="must refuse a connection")
    args = parser.parse_args(argv)

    result: dict[str, Any] = {"proxy_health": _health(args.fleet, args.ca)}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "fleet"\n\n[superlink.fleet]\n'
            f'address = "{args.fleet}"\nroot-certificates = "{args.ca}"\n'
        )
        result["fleet"] = {
            "run": _flwr(home, "run", args.app, "fleet"),
            "register": _flwr(home, "supernode", "register", args.pubkey, "fleet"),
            "stop": _flwr(home, "stop", args.run_id, "fleet"),
            "claim": _claim(args.fleet, args.ca),
        }
    result["closed"] = {address: _connect(address) for address in args.closed}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
