"""Names of the pruning options, apart from :mod:`edgefleet.pruning.importance` so that the run
config can check them without importing torch."""

from enum import StrEnum


class Criterion(StrEnum):
    """How channels are scored for pruning (``pruning.criterion``)."""

    CURVATURE = "curvature"
    MAGNITUDE = "magnitude"
    RANDOM = "random"
    # By position, not score (edgefleet.pruning.widthslice): HeteroFL's and FedRolex's slices.
    PREFIX = "prefix"
    ROLLING = "rolling"
    # FjORD: a prefix of a width drawn every local step (edgefleet.pruning.ordered_dropout).
    ORDERED_DROPOUT = "ordered-dropout"


CRITERIA: tuple[str, ...] = tuple(m.value for m in Criterion)
POSITIONAL_CRITERIA: tuple[str, ...] = (
    Criterion.PREFIX.value,
    Criterion.ROLLING.value,
    Criterion.ORDERED_DROPOUT.value,
)


class HessianEstimator(StrEnum):
    """The curvature estimate (``pruning.hessian``)."""

    FISHER = "fisher"
    HUTCHINSON = "hutchinson"


HESSIAN_ESTIMATORS: tuple[str, ...] = tuple(m.value for m in HessianEstimator)


# The curvature criterion's per-weight score: taylor = |g w - h w^2 / 2| (the second-order
# Taylor estimate of the loss change when the weight is removed); signed = g w + h w^2, summed
# per channel with the lowest pruned first, as the CA-HFP seed writes it.
class CurvatureScore(StrEnum):
    """The curvature score's form (``pruning.score``)."""

    TAYLOR = "taylor"
    SIGNED = "signed"


CURVATURE_SCORES: tuple[str, ...] = tuple(m.value for m in CurvatureScore)


# What a keep ratio is a share of: the submodel's parameters, its forward multiply-accumulates,
# or the channels of every group (then parameters between two pruned layers scale about r^2).
class Budget(StrEnum):
    """What a keep ratio is a share of (``pruning.budget``)."""

    PARAMETERS = "parameters"
    COMPUTE = "compute"
    CHANNELS = "channels"


BUDGETS: tuple[str, ...] = tuple(m.value for m in Budget)


# global: CA-HFP's reconstruction (pruned entries from the global model), then the
# strategy's aggregation; elementwise: each entry averaged over the clients that kept it;
# zeros: the paper's ablation without reconstruction.
class Reconstruction(StrEnum):
    """How the server fills pruned coordinates (``pruning.reconstruction``)."""

    GLOBAL = "global"
    ELEMENTWISE = "elementwise"
    ZEROS = "zeros"


RECONSTRUCTIONS: tuple[str, ...] = tuple(m.value for m in Reconstruction)
