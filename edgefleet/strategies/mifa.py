"""MIFA: the server averages every device's latest update, present or not.

"Fast Federated Learning in the Presence of Arbitrary Device Unavailability", Gu, Huang,
Zhang, Huang, NeurIPS 2021 (arXiv 2106.04159). The server keeps G_i, the latest update of
each of the N devices (zero until it first takes part), replaces G_i by the new update of
every device that took part this round, and moves the global model by the mean of all N:

    G_i <- delta_i for i in S_t;    theta <- theta + server_lr * (1/N) sum_{i=1..N} G_i

This is EdgeFleet's FedSAG with ``estimator="sag"``, ``mean_over="fleet"`` and
``init="zeros"`` (the SAG direction: the memory mean after the participants' memories are
replaced), so :class:`MIFA` is that configuration, fixed, under the paper's name. N is the
devices the server has registered (every device that answered a status query under
energy-age selection, else every device that replied); the paper's N is the whole fleet,
known in advance: the two agree once every device has been heard from. The paper's
learning-rate decay (eta_t = eta_0 / t) is the run's ``lr-schedule``, not part of this rule.
"""

from __future__ import annotations

from typing import Any

from edgefleet.algorithms.saga import SagaError
from edgefleet.strategies.fedsag import FedSAG

# The FedSAG settings that make it MIFA; a caller may not change them.
MIFA_FORM: dict[str, Any] = {"estimator": "sag", "mean_over": "fleet", "init": "zeros"}


class MIFA(FedSAG):
    """MIFA (Gu et al., NeurIPS 2021): the mean of every device's latest update (module
    docstring). Takes FedSAG's other settings (``server_lr``, ``robust``, ``max_age``) and
    FedAvg's keyword arguments."""

    FIXED_FORM = (*MIFA_FORM, "correction")

    def __init__(self, server_lr: float = 1.0, **kwargs: Any) -> None:
        fixed = sorted(k for k in kwargs if k in (*MIFA_FORM, "correction", "correction_floor"))
        if fixed:
            raise SagaError(
                f"MIFA fixes {', '.join(fixed)} (its direction is the mean of every device's "
                "latest update); use FedSAG to choose them"
            )
        super().__init__(server_lr=server_lr, **MIFA_FORM, **kwargs)
