"""FedVARP: SAGA-style variance reduction on the server for partial participation.

"FedVARP: Tackling the Variance Due to Partial Client Participation in Federated Learning",
Jhunjhunwala, Sharma, Nagarkatti, Joshi, UAI 2022 (arXiv 2207.14130), Algorithm 1. The
server keeps y_i, the last update of each of the N clients (zero at the start), and steps

    v_t = (1/|S_t|) sum_{i in S_t} (delta_i - y_i)  +  (1/N) sum_{j=1..N} y_j
    y_i <- delta_i for i in S_t;    theta <- theta + server_lr * v_t

This is EdgeFleet's FedSAG with ``estimator="saga"``, ``correction="participants"`` (1/|S|),
``mean_over="fleet"`` and ``init="zeros"``, so :class:`FedVARP` is that configuration, fixed.
It differs from EH-FedSAG's seed form only in the memory mean (FedVARP divides by all N
clients, the seed by the clients that have a memory) and from EdgeFleet's default FedSAG only
in the correction weight (EdgeFleet's 1/max(|S|, M) under energy-age selection). N is the
devices the server has registered (see :mod:`edgefleet.strategies.mifa`). The paper samples
clients uniformly; here they come from whatever selection wraps it (energy-age selection in
EdgeFleet's EH runs), which is outside the paper's analysis.
"""

from __future__ import annotations

from typing import Any

from edgefleet.algorithms.saga import SagaError
from edgefleet.strategies.fedsag import FedSAG

FEDVARP_FORM: dict[str, Any] = {
    "estimator": "saga",
    "correction": "participants",
    "mean_over": "fleet",
    "init": "zeros",
}


class FedVARP(FedSAG):
    """FedVARP (Jhunjhunwala et al., UAI 2022), Algorithm 1 (module docstring). Takes
    FedSAG's other settings (``server_lr``, ``robust``, ``max_age``) and FedAvg's keyword
    arguments."""

    FIXED_FORM = (*FEDVARP_FORM, "correction")

    def __init__(self, server_lr: float = 1.0, **kwargs: Any) -> None:
        fixed = sorted(k for k in kwargs if k in (*FEDVARP_FORM, "correction_floor"))
        if fixed:
            raise SagaError(
                f"FedVARP fixes {', '.join(fixed)} (Algorithm 1 of arXiv 2207.14130); use "
                "FedSAG to choose them"
            )
        super().__init__(server_lr=server_lr, **FEDVARP_FORM, **kwargs)
