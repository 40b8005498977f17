"""Names of the pruning options, apart from :mod:`edgefleet.pruning.importance` so that the run
config can check them without importing torch."""

CRITERIA: tuple[str, ...] = ("curvature", "magnitude", "random")
HESSIAN_ESTIMATORS: tuple[str, ...] = ("fisher", "hutchinson")
# The curvature criterion's per-weight score: taylor = |g w - h w^2 / 2| (the second-order
# Taylor estimate of the loss change when the weight is removed); signed = g w + h w^2, summed
# per channel with the lowest pruned first, as the CA-HFP seed writes it.
CURVATURE_SCORES: tuple[str, ...] = ("taylor", "signed")
# What a keep ratio is a share of: the submodel's parameters, its forward multiply-accumulates,
# or the channels of every group (then parameters between two pruned layers scale about r^2).
BUDGETS: tuple[str, ...] = ("parameters", "compute", "channels")
# global: CA-HFP's reconstruction (pruned entries from the global model), then the
# strategy's aggregation; elementwise: each entry averaged over the clients that kept it;
# zeros: the paper's ablation without reconstruction.
RECONSTRUCTIONS: tuple[str, ...] = ("global", "elementwise", "zeros")
