import pytest
import torch

from edgefleet.task.models import MODELS, build_model


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    ("shape", "classes"), [((1, 28, 28), 10), ((3, 32, 32), 10), ((1, 8, 8), 3)]
)
def test_output_shape(name: str, shape: tuple[int, int, int], classes: int) -> None:
    model = build_model(name, shape, classes)
    out = model(torch.zeros(4, *shape))
    assert out.shape == (4, classes)


def _count(name: str, shape: tuple[int, int, int], classes: int) -> int:
    return sum(p.numel() for p in build_model(name, shape, classes).parameters())


def test_parameter_counts_by_hand() -> None:
    assert _count("linear", (1, 28, 28), 10) == 784 * 10 + 10
    assert _count("mlp", (1, 28, 28), 10) == (784 * 200 + 200) + (200 * 200 + 200) + (200 * 10 + 10)
    # SmallCNN: conv 3x3 32 -> conv 3x3 64 -> two 2x2 pools (28 -> 7) -> fc128 -> fc10
    conv1 = 1 * 9 * 32 + 32
    conv2 = 32 * 9 * 64 + 64
    fc1 = 64 * 7 * 7 * 128 + 128
    fc2 = 128 * 10 + 10
    assert _count("smallcnn", (1, 28, 28), 10) == conv1 + conv2 + fc1 + fc2


def test_resnet_depths() -> None:
    r8 = build_model("resnet8", (3, 32, 32), 10)
    r20 = build_model("resnet20", (3, 32, 32), 10)
    convs8 = sum(isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3) for m in r8.modules())
    convs20 = sum(isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3) for m in r20.modules())
    # 6n+2 layers: stem conv + 2 per block + fc
    assert convs8 + 1 == 8
    assert convs20 + 1 == 20
    # CIFAR ResNet-20 has about 0.27M parameters (He et al. 2016), plus two 1x1 projections
    assert 260_000 < _count("resnet20", (3, 32, 32), 10) < 290_000


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="valid choices: linear, mlp, smallcnn"):
        build_model("vgg16", (1, 28, 28), 10)
