"""Names of the models, kept apart from :mod:`edgefleet.task.models` so that validating a
run config (and starting the ``edgefleet`` CLI) does not import torch (about 3 s)."""

from enum import StrEnum


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
