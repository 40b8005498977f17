"""Names of the models, kept apart from :mod:`edgefleet.task.models` so that validating a
run config (and starting the ``edgefleet`` CLI) does not import torch (about 3 s)."""

MODELS: tuple[str, ...] = ("linear", "mlp", "smallcnn", "resnet8", "resnet20")

# Where training, evaluation and pruning scores run (edgefleet.task.accelerator).
ACCELERATORS: tuple[str, ...] = ("auto", "cpu", "cuda", "mps")
