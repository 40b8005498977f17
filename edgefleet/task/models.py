"""Models sized for edge devices. Input shape and class count come from the data set.

Choose ``linear`` or ``mlp`` for quick checks, ``smallcnn`` (the CNN of the EH-FedSAG
experiments) as the default, and ``resnet8``/``resnet20`` when BatchNorm and residual
connections matter (e.g. for structured pruning). The ResNets are the CIFAR-style ones of He
et al. (3x3 stem, three stages of 16/32/64 channels); torchvision's ResNets are ImageNet-style
(7x7 stride-2 stem and max-pool) and would shrink a 28x28 image to nothing, and importing
torchvision here would make it a hard dependency of every edge node.
"""

from __future__ import annotations

import torch
from torch import nn

from edgefleet.task.names import MODELS, ModelName


class LinearClassifier(nn.Module):
    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        self.fc = nn.Linear(c * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x, 1))


class MLP(nn.Module):
    def __init__(
        self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 200
    ) -> None:
        super().__init__()
        c, h, w = input_shape
        self.fc1 = nn.Linear(c * h * w, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc3(torch.relu(self.fc2(x)))


class SmallCNN(nn.Module):
    """conv32 -> conv64 -> fc128 -> classes, as in the EH-FedSAG experiments.

    3x3 convolutions with padding keep the spatial size, and each is followed by a 2x2
    max-pool, so the same network fits 8x8 digits, 28x28 MNIST and 32x32 CIFAR-10.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(64 * (h // 4) * (w // 4), 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        # A 1x1 projection (option B) rather than zero-padding (option A): its channels
        # are real tensors, so dependency-aware pruning can slice them with the block.
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet-(6n+2): ``blocks_per_stage`` = 1 gives ResNet-8, 3 gives ResNet-20."""

    def __init__(
        self, input_shape: tuple[int, int, int], num_classes: int, blocks_per_stage: int
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        in_ch = 16
        for stage, out_ch in enumerate((16, 32, 64)):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(in_ch, out_ch, stride))
                in_ch = out_ch
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.pool(self.layers(x))
        return self.fc(torch.flatten(x, 1))


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Build model ``name`` for inputs of ``input_shape`` (C, H, W) and ``num_classes``."""
    if name == ModelName.LINEAR:
        return LinearClassifier(input_shape, num_classes)
    if name == ModelName.MLP:
        return MLP(input_shape, num_classes)
    if name == ModelName.SMALLCNN:
        return SmallCNN(input_shape, num_classes)
    if name == ModelName.RESNET8:
        return ResNet(input_shape, num_classes, blocks_per_stage=1)
    if name == ModelName.RESNET20:
        return ResNet(input_shape, num_classes, blocks_per_stage=3)
    raise ValueError(f"unknown model {name!r}; valid choices: {', '.join(MODELS)}")
