"""Names of the pruning options, apart from :mod:`edgefleet.pruning.importance` so that the run
config can check them without importing torch."""

CRITERIA: tuple[str, ...] = ("curvature", "magnitude", "random")
HESSIAN_ESTIMATORS: tuple[str, ...] = ("fisher", "hutchinson")
# global: CA-HFP's reconstruction (pruned entries from the global model), then the
# strategy's aggregation; elementwise: each entry averaged over the clients that kept it;
# zeros: the paper's ablation without reconstruction.
RECONSTRUCTIONS: tuple[str, ...] = ("global", "elementwise", "zeros")
