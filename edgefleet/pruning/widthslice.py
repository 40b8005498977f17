"""Width slices by position: the channels HeteroFL and FedRolex give a device of keep ratio r.

Both cut the same physically smaller submodel as CA-HFP (every structural group keeps
``PruningPlan.channel_counts(r, budget)[g]`` channels) but choose *which* channels by
position instead of by a score measured on local data:

- ``prefix`` (HeteroFL: "HeteroFL: Computation and Communication Efficient Federated Learning
  for Heterogeneous Clients", Diao, Ding, Tarokh, ICLR 2021, arXiv 2010.01264): the first
  k_g channels of every group, the same every round, so small models are nested in large ones.
- ``rolling`` (FedRolex: "FedRolex: Model-Heterogeneous Federated Learning with Rolling
  Sub-Model Extraction", Alam, Liu, Yan, Zhang, NeurIPS 2022, arXiv 2212.01548): a window of
  k_g consecutive channels (cyclically) that starts at channel (t - 1) mod n_g in round t, so
  over n_g rounds every channel of the global model is trained by small devices too.

The server then averages every entry over the devices that kept it (``pruning.reconstruction =
"elementwise"``), which is HeteroFL's and FedRolex's aggregation. Neither needs data or a
backward pass on the device, unlike CA-HFP's curvature score.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def prefix_kept(counts: Mapping[str, int]) -> dict[str, np.ndarray]:
    """HeteroFL's slice: channels 0..k_g-1 of every group g (int64, ascending)."""
    return {g: np.arange(k, dtype=np.int64) for g, k in counts.items()}


def rolling_kept(
    groups: Mapping[str, int], counts: Mapping[str, int], server_round: int
) -> dict[str, np.ndarray]:
    """FedRolex's slice in round ``server_round`` (1-based): channels (t - 1 + i) mod n_g,
    i < k_g, of every group g of n_g channels (int64, ascending)."""
    if server_round < 1:
        raise ValueError(f"server_round must be >= 1, got {server_round}")
    out = {}
    for g, n in groups.items():
        k = counts[g]
        if not 1 <= k <= n:
            raise ValueError(f"group {g!r}: {k} channels kept of {n}")
        out[g] = np.sort((server_round - 1 + np.arange(k)) % n).astype(np.int64)
    return out
