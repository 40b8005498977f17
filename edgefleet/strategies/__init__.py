"""EdgeFleet's techniques as Flower strategies, usable in any Flower ServerApp.

Each is a ``flwr.serverapp.strategy.Strategy``; wrap your own (Flower's ``FedAvg``, say)::

    from edgefleet.strategies import TaskVectorStopping
    result = TaskVectorStopping(FedAvg()).start(grid, arrays, num_rounds=500)

- :class:`TaskVectorStopping`: data-free early stopping from the global task vector
  (arXiv 2601.22669); :class:`ValidationStopping` is the validation baseline.
- :class:`RobustAggregation`: a robust rule (median, trimmed mean, MultiKrum, centered
  clipping) in place of a FedAvg-family weighted mean, mask-aware under CA-HFP.
- :class:`EnergyAgeSelection`: energy-aware, age-based selection of at most M devices a
  round; :class:`FedSAG`: SAGA server memory (EH-FedSAG, arXiv 2606.18758). The field's
  baselines beside it: :class:`MIFA`, :class:`FedVARP`, and :class:`Scaffold` (which needs a
  ClientApp that applies its correction; docs/explanation/field-baselines.md).
- :class:`SubmodelReconstruction`: rebuilds CA-HFP's pruned submodels into the full
  parameter space before aggregation (arXiv 2603.12591).
- :class:`WarmStartInitializer`: sessions over a changing device set, each warm-started from
  the stored sessions' models (arXiv 2410.05662); :class:`SessionLearningRate` (the
  per-session client learning rate) and :class:`ContinuousTeacher` (the Continuous
  baseline's KL teacher) are wrappers of their own that it adds.
- :class:`FedBuff`: buffered asynchronous aggregation (Nguyen et al. 2022) around your
  strategy, run by :class:`AsyncLoop` instead of the round loop: no round barrier, each
  update discounted by its staleness.

They run in :class:`RoundLoop` (``start()`` does this for you), which keeps the run's
:class:`DeviceRegistry` (which node is which device, what each said and did), hands every
wrapper the round's :class:`RoundContext`, and screens every reply on its own, so a
standard Flower reply (arrays + metrics with ``num-examples``) is valid and a malformed one
is dropped with its reason. Nothing here imports EdgeFleet's apps or torch.
"""

from edgefleet.algorithms.saga import SagaMemory
from edgefleet.algorithms.tracker import SessionTracker
from edgefleet.algorithms.warmstart import SessionStore
from edgefleet.loop.asyncloop import AsyncLoop, FedBuff
from edgefleet.loop.base import LoopStrategy, SubsetGrid
from edgefleet.loop.context import RoundContext, current_round
from edgefleet.loop.hooks import StrategyHooks, hooks_of
from edgefleet.loop.registry import DeviceRecord, DeviceRegistry, DeviceStatus
from edgefleet.loop.roundloop import LoopOutcome, RoundCallback, RoundLoop, RoundResult
from edgefleet.loop.screening import RecordKeys, check_train_reply
from edgefleet.loop.status import Declaration, StatusQuery
from edgefleet.strategies.energy_selection import EnergyAgeSelection
from edgefleet.strategies.equalweight import EqualWeightFedAvg
from edgefleet.strategies.fedsag import FedSAG
from edgefleet.strategies.fedvarp import FedVARP
from edgefleet.strategies.lrschedule import SessionLearningRate
from edgefleet.strategies.mifa import MIFA
from edgefleet.strategies.reconstruction import SubmodelReconstruction
from edgefleet.strategies.robust import RobustAggregation, RobustRule
from edgefleet.strategies.scaffold import Scaffold
from edgefleet.strategies.stopping import TaskVectorStopping, ValidationStopping
from edgefleet.strategies.teacher import ContinuousTeacher
from edgefleet.strategies.warmstart_initializer import WarmStartInitializer

__all__ = [
    "AsyncLoop",
    "ContinuousTeacher",
    "Declaration",
    "DeviceRecord",
    "DeviceRegistry",
    "DeviceStatus",
    "EnergyAgeSelection",
    "EqualWeightFedAvg",
    "FedBuff",
    "FedSAG",
    "FedVARP",
    "LoopOutcome",
    "LoopStrategy",
    "MIFA",
    "RecordKeys",
    "RoundCallback",
    "RoundContext",
    "RoundLoop",
    "RobustAggregation",
    "RobustRule",
    "RoundResult",
    "SagaMemory",
    "Scaffold",
    "SessionLearningRate",
    "SessionStore",
    "SessionTracker",
    "StatusQuery",
    "StrategyHooks",
    "SubmodelReconstruction",
    "SubsetGrid",
    "TaskVectorStopping",
    "ValidationStopping",
    "WarmStartInitializer",
    "check_train_reply",
    "current_round",
    "hooks_of",
]
