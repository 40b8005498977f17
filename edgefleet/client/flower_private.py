"""Flower's internals that the warm worker (:mod:`edgefleet.client.worker`) builds on, in one
place, checked against the Flower version they were read from.

The worker runs ClientApp tasks the way ``flwr-clientapp`` does, with Flower's own functions
for it; none of them is public API (``flwr.supernode``, ``flwr.supercore``, ``flwr.proto``,
``flwr.cli.install``, ``flwr.clientapp.utils`` and a few constants), so any Flower release
may move or change them. Importing this module fails at once, naming the problem, when the
installed Flower is not the ``major.minor`` the worker was checked against or a name is
missing; ``tests/test_flower_private.py`` imports each name. After a Flower upgrade: read
the worker's uses of these names against the new release, then raise ``CHECKED_AGAINST``.

Like the worker, this module imports only flwr and the standard library: ``deploy/pi/``
ships it beside ``worker.py`` (a board has no EdgeFleet install).
"""

from __future__ import annotations

import flwr

CHECKED_AGAINST = "1.42"  # flwr major.minor whose internals the worker was read against


class FlowerVersionError(ImportError):
    """The installed Flower is not the one EdgeFleet's worker was checked against."""


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


if _major_minor(flwr.__version__) != CHECKED_AGAINST:
    raise FlowerVersionError(
        f"EdgeFleet's warm worker uses Flower internals checked against flwr "
        f"{CHECKED_AGAINST}.x; flwr {flwr.__version__} is installed. Install "
        f"flwr=={CHECKED_AGAINST}.* (EdgeFleet's pinned version), or run a plain "
        "flower-supernode without the worker"
    )

try:
    from flwr.cli.install import install_from_fab
    from flwr.clientapp.client_app import ClientApp, LoadClientAppError
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.config import get_project_dir
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
        AcquireTaskRequest,
        SendTaskHeartbeatRequest,
    )
    from flwr.supercore import log
    from flwr.supercore.constant import (
        SUPERNODE_UVICORN_DEFAULT_PORT,
        UVICORN_DEFAULT_HOST,
        TaskType,
    )
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )
    from flwr.supercore.retry import RetryInvoker, exponential
    from flwr.supercore.run import RunNotRunningException
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime import run_clientapp
except ImportError as err:
    raise FlowerVersionError(
        f"flwr {flwr.__version__} lacks a Flower internal that EdgeFleet's warm worker uses "
        f"({err}); edgefleet/client/flower_private.py was checked against flwr "
        f"{CHECKED_AGAINST}.x"
    ) from err

# What the worker uses of run_clientapp, flwr-clientapp's own steps (and the one it patches).
RUN_CLIENTAPP_FUNCTIONS = (
    "pull_task_input",
    "pull_and_inflate_object_from_tree",
    "push_message",
    "push_task_output",
)
_missing = [name for name in RUN_CLIENTAPP_FUNCTIONS if not hasattr(run_clientapp, name)]
if _missing:
    raise FlowerVersionError(
        f"flwr {flwr.__version__}'s flwr.supernode.runtime.run_clientapp lacks "
        f"{', '.join(_missing)}, which EdgeFleet's warm worker uses; "
        f"edgefleet/client/flower_private.py was checked against flwr {CHECKED_AGAINST}.x"
    )

__all__ = [
    "CHECKED_AGAINST",
    "SUPERNODE_UVICORN_DEFAULT_PORT",
    "UVICORN_DEFAULT_HOST",
    "AcquireTaskRequest",
    "ClientApp",
    "ErrorCode",
    "FlowerVersionError",
    "HeartbeatSender",
    "LoadClientAppError",
    "RetryInvoker",
    "RunNotRunningException",
    "RuntimeHttpClient",
    "RuntimeTokenHttpInterceptor",
    "RuntimeVersionHttpInterceptor",
    "SendTaskHeartbeatRequest",
    "SubStatus",
    "SuperExecAuthHttpInterceptor",
    "TaskType",
    "exponential",
    "get_load_client_app_fn",
    "get_project_dir",
    "install_from_fab",
    "log",
    "run_clientapp",
]
