"""Names of the pruning options, apart from :mod:`edgefleet.pruning.importance` so that the run
config can check them without importing torch."""

CRITERIA: tuple[str, ...] = ("curvature", "magnitude", "random")
HESSIAN_ESTIMATORS: tuple[str, ...] = ("fisher", "hutchinson")
