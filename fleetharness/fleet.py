"""Deployment-Engine fleets for tests, benchmarks and deploy scripts (not in the wheel).

:class:`DeploymentFleet` is :class:`edgefleet.processes.FlowerFleet` (which ``edgefleet
run`` uses for its own SuperLink and Ray head) plus what only a test or a deploy script
does: start SuperNodes against the SuperLink and wait for them to be listed online.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edgefleet.processes import (
    FleetError,
    FlowerFleet,
    FlowerProcess,
    _is_supernode,
    _processes,
    _stop_groups,
    config_arg,
    free_port,
)


def write_superexec_secret(path: Path) -> Path:
    """A new SuperExec secret (32 random bytes, hex) in ``path``, created with mode 0600
    (never readable by another user, not even for a moment); ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def processes_with_env(marker: str) -> list[str]:
    """``"pid: command"`` of each live (non-zombie) process whose environment holds
    ``marker`` (e.g. ``"FLWR_HOME=/tmp/x"``; a prefix of a variable's value matches too)."""
    return [
        f"{info.pid}: {info.cmd}"
        for info, environ in _processes()
        if info.state != "Z" and info.pid != os.getpid() and marker.encode() in environ
    ]


class DeploymentFleet(FlowerFleet):
    """A :class:`~edgefleet.processes.FlowerFleet` that also starts SuperNodes and asks the
    SuperLink which are online (``flwr supernode ls``)."""

    def start_supernode(
        self,
        node_config: Mapping[str, Any],
        extra_args: Sequence[str] = (),
        *,
        name: str | None = None,
        warm: bool = False,
    ) -> FlowerProcess:
        """A SuperNode connected to our SuperLink, its Runtime API on a free port, ClientApps
        in subprocesses (``warm``: ``edgefleet supernode``, every ClientApp message in one
        warm worker process, :mod:`edgefleet.client.worker`). ``--insecure`` unless the
        SuperLink has TLS (then it gets ``--root-certificates``)."""
        if self.superlink_address is None:
            raise FleetError("start the SuperLink first")
        args = ["edgefleet", "supernode"] if warm else ["flower-supernode"]
        if self.root_certificates is None:
            args.append("--insecure")
        else:
            args += ["--root-certificates", str(self.root_certificates)]
        args += [
            "--superlink",
            self.superlink_address,
            "--port",
            str(free_port()),
            "--node-config",
            config_arg(node_config),
            *extra_args,
        ]
        return self.start(name or f"supernode-{len(self.supernodes())}", args)

    def supernodes(self) -> list[FlowerProcess]:
        return [p for p in self.processes if _is_supernode(p)]

    def flwr_output(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``flwr ARGS`` to completion (bounded); its output, or ``FleetError``."""
        proc = self.flwr(*args, name="flwr-cli")
        try:
            rc = proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_groups([proc])
            raise FleetError(f"`flwr {' '.join(args)}` ran past {timeout:.0f} s") from None
        output = proc.log_path.read_text(errors="replace")
        if rc != 0:
            raise FleetError(f"`flwr {' '.join(args)}` exited with code {rc}:\n{output}")
        return output

    def online_nodes(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """The SuperNodes the SuperLink lists as online (``flwr supernode ls --format json``)."""
        output = self.flwr_output(
            "supernode", "ls", self.connection, "--format", "json", timeout=timeout
        )
        start = output.find("{")
        if start < 0:
            raise FleetError(f"no JSON in `flwr supernode ls` output:\n{output}")
        data = json.loads(output[start:])
        return [n for n in data.get("nodes", []) if n.get("status") == "online"]

    def wait_for_nodes(self, count: int, timeout: float = 60.0) -> None:
        """Wait until ``count`` SuperNodes are online; fail early if a SuperNode dies."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            online = len(self.online_nodes(timeout=max(5.0, deadline - time.monotonic())))
            if online >= count:
                return
            if time.monotonic() > deadline:
                raise FleetError(f"{online} of {count} SuperNodes online after {timeout:.0f} s")
            time.sleep(1.0)
