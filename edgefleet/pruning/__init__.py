"""CA-HFP: curvature-aware structured pruning with server-side reconstruction (arXiv 2603.12591).

- :mod:`edgefleet.pruning.importance` (client): per-weight scores (curvature, magnitude, random).
- :mod:`edgefleet.pruning.submodel` (both sides): ``PruningPlan`` - channel groups, selection,
  physically smaller submodels and the index maps from compact to full tensors.
- :mod:`edgefleet.pruning.reconstruct` (server): scatter compact updates back to full size, or
  average every entry over the clients that kept it. Pure NumPy.

Nothing is re-exported here, so that importing the NumPy-only reconstruction does not import
torch and Torch-Pruning.
"""
