"""Try to claim a task on a Flower Runtime API, as a rogue SuperExec would; print one JSON line.

    python deploy/runtime_claim.py HOST:PORT [--root-certificates CA] [--secret-file FILE]

It sends what ``flower-superexec`` sends to take the oldest pending task (a ServerApp or
ClientApp run, with the token that lets its holder read the run's inputs and write its
results): ``AcquireTask`` over Flower's own Runtime HTTP client, signed with the SuperExec
secret when ``--secret-file`` is given (Flower's HMAC headers), unsigned otherwise. Exit
status 0 when the Runtime API answered the claim (``"claimed": true``, whether or not a task
was pending), 1 when it was refused or unreachable (``"error"`` says how). No retries.

The attacker tests run it from outside the fleet: tests/test_compose.py inside a container on
a network of its own, tests/test_deployment_exposure.py inside a network namespace. It needs
only ``flwr`` (1.42), so it also runs in the ``flwr/superexec`` image.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def claim(address: str, root_certificates: str | None, secret: bytes | None) -> dict[str, object]:
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # type: ignore[attr-defined]
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import (
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )
    from flwr.supercore.protobuf.client import ProtobufClientInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors: list[ProtobufClientInterceptor] = [
        RuntimeVersionHttpInterceptor(component_name="SuperExec")
    ]
    if secret is not None:
        interceptors.append(
            SuperExecAuthHttpInterceptor(
                master_secret=secret, protected_methods={"/flwr.proto.Runtime/AcquireTask"}
            )
        )
    client = RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=interceptors,
    )
    try:
        res = client.AcquireTask(
            AcquireTaskRequest(supported_task_types=[t.value for t in TaskType])
        )
    except Exception as e:  # noqa: BLE001 - the refusal is the answer we report
        return {"claimed": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        client.close()
    return {"claimed": True, "task": res.HasField("task") and bool(res.token)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("address", help="the Runtime API, HOST:PORT")
    parser.add_argument("--root-certificates", help="CA certificate (TLS); plain HTTP without")
    parser.add_argument("--secret-file", type=Path, help="the SuperExec secret, to sign with")
    args = parser.parse_args(argv)
    secret = args.secret_file.read_bytes() if args.secret_file else None
    result = claim(args.address, args.root_certificates, secret)
    print(json.dumps(result))
    return 0 if result["claimed"] else 1


if __name__ == "__main__":
    sys.exit(main())
