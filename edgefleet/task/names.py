"""Names of the models, kept apart from :mod:`edgefleet.task.models` so that validating a
run config (and starting the ``edgefleet`` CLI) does not import torch (about 3 s)."""

MODELS: tuple[str, ...] = ("linear", "mlp", "smallcnn", "resnet8", "resnet20")
