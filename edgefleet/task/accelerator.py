"""Where local training, evaluation, pruning scores and central evaluation run.

``accelerator`` (run config; a SuperNode's ``--node-config accelerator=...`` wins for that
device): ``auto`` takes CUDA when torch sees a CUDA device, else Apple's MPS, else the CPU;
``cpu``, ``cuda`` and ``mps`` ask for one. Asking for one the machine lacks is an error that
names what is there, raised before any data is loaded. The model is moved once, when the
device (or the server's evaluation model) is built; batches follow the model
(:func:`edgefleet.task.train.model_device`), and arrays leave as CPU NumPy whatever the
accelerator. On a CPU-only machine every choice but ``cuda``/``mps`` gives the CPU path of
before, bit for bit (tests/test_accelerator.py).

Under the Simulation Engine Ray hides the GPUs from actors that asked for none
(``CUDA_VISIBLE_DEVICES=""``), so give ClientApps a share with the federation key
``client-resources-num-gpus`` (``edgefleet run`` sets one when a GPU is present and the
scenario sets none: :func:`simulation_gpu_share`).

torch is imported inside the functions: the run-config check and ``edgefleet run`` must not
pay for it on a machine without a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from edgefleet.errors import SettingError
from edgefleet.task.names import ACCELERATORS, Accelerator

if TYPE_CHECKING:
    import torch


class AcceleratorError(SettingError):
    """An accelerator was asked for that this machine (or this torch build) does not have."""


def available_accelerators() -> list[str]:
    """The accelerators torch can use here, ``cpu`` always first."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def resolve_accelerator(name: str) -> torch.device:
    """The torch device for ``name`` (``auto``: cuda, else mps, else cpu)."""
    import torch

    if name not in ACCELERATORS:
        raise AcceleratorError(f"accelerator {name!r}: valid choices are {', '.join(ACCELERATORS)}")
    if name == Accelerator.CPU:
        return torch.device("cpu")
    have = available_accelerators()
    if name == Accelerator.AUTO:
        return torch.device("cuda" if "cuda" in have else "mps" if "mps" in have else "cpu")
    if name not in have:
        build = f"torch {torch.__version__}"
        if name == Accelerator.CUDA and torch.version.cuda is None:
            build += ", a build without CUDA"
        elif name == Accelerator.CUDA and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
            build += "; CUDA_VISIBLE_DEVICES is empty (a Ray actor given no GPU?)"
        raise AcceleratorError(
            f"accelerator {name!r} requested but this machine has none ({build}); "
            f"available here: {', '.join(have)}"
        )
    return torch.device(name)


def _nvidia_gpus_present() -> bool:
    """Whether an NVIDIA driver reports a GPU, without importing torch (Linux)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def simulation_gpu_share(accelerator: str, client_cpus: float) -> float | None:
    """The ``client-resources-num-gpus`` each Ray actor should ask for so that ClientApps see
    the GPUs (None: leave the federation as it is). Every actor Ray can place by its CPUs
    gets an equal share of the GPUs: ``gpus * client_cpus / cpus``, at most 1.

    Raises :class:`AcceleratorError` when ``cuda`` is asked for and none is present."""
    if accelerator in (Accelerator.CPU, Accelerator.MPS):
        return None
    if accelerator == Accelerator.AUTO and not _nvidia_gpus_present():
        return None  # a CPU-only machine: exactly as before, and torch stays unimported
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        if accelerator == Accelerator.CUDA:
            resolve_accelerator("cuda")  # raises, naming what there is
        return None
    cpus = os.cpu_count() or 1
    return min(1.0, round(gpus * max(client_cpus, 1.0) / cpus, 4))
