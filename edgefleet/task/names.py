"""Names of the models, kept apart from :mod:`edgefleet.task.models` so that validating a
run config (and starting the ``edgefleet`` CLI) does not import torch (about 3 s)."""

from dataclasses import dataclass
from enum import StrEnum

from edgefleet.settings import at_least, choice, fraction, half_open_fraction, positive, setting


class ModelName(StrEnum):
    """The model architectures (``model``)."""

    LINEAR = "linear"
    MLP = "mlp"
    SMALLCNN = "smallcnn"
    RESNET8 = "resnet8"
    RESNET20 = "resnet20"


MODELS: tuple[str, ...] = tuple(m.value for m in ModelName)

# Where training, evaluation and pruning scores run (edgefleet.task.accelerator).


class Accelerator(StrEnum):
    """Where training runs (``accelerator``)."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"
    MPS = "mps"


ACCELERATORS: tuple[str, ...] = tuple(m.value for m in Accelerator)


class LrSchedule(StrEnum):
    """The learning-rate schedule (``lr-schedule``); ``session-poly``: the reference's
    polynomial decay within each session (arXiv 2410.05662)."""

    CONSTANT = "constant"
    SESSION_POLY = "session-poly"


LR_SCHEDULES: tuple[str, ...] = tuple(m.value for m in LrSchedule)


@dataclass(frozen=True)
class TrainConfig:
    model: str = setting("model", "smallcnn", choice(MODELS), " ".join(f"`{m}`" for m in MODELS))
    lr: float = setting("lr", 0.05, positive, "local SGD learning rate")
    lr_schedule: str = setting(
        "lr-schedule",
        "constant",
        choice(LR_SCHEDULES),
        "`constant`, or `session-poly`: within each session the rate decays from `lr` to "
        "`lr` x `lr-min-ratio` (power 0.9, as arXiv 2410.05662's code; needs "
        "`sessions.rounds`); the server sends each round's rate in the train config",
    )
    lr_min_ratio: float = setting(
        "lr-min-ratio", 0.6, fraction, "`session-poly`: the last rate of a session over `lr`"
    )
    momentum: float = setting("momentum", 0.9, half_open_fraction, "local SGD momentum")
    batch_size: int = setting("batch-size", 32, at_least(1), "local mini-batch size")
    local_steps: int = setting("local-steps", 20, at_least(1), "local SGD steps a round")
    proximal_mu: float = setting("proximal-mu", 0.01, at_least(0.0), "FedProx's mu")
    client_threads: int = setting(
        "client-threads", 1, at_least(1), "torch threads per ClientApp process"
    )
    accelerator: str = setting(
        "accelerator",
        "auto",
        choice(ACCELERATORS),
        "where training, evaluation and pruning scores run: `auto` (cuda, else mps, else "
        "cpu), `cpu`, `cuda`, `mps`; a SuperNode's `--node-config accelerator=...` wins",
    )
