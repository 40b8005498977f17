"""What a device is: its identity, its local data and a model to train, built once per process.

Flower's quickstart rebuilds the data set and the model on every message; on a simulation
that is a large share of the time. A :class:`Device` is built on the first message a
process sees for a (run config, node) pair and reused for every later round.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from edgefleet.config import RunConfig, parse_run_config
from edgefleet.errors import SettingError
from edgefleet.task.accelerator import resolve_accelerator
from edgefleet.task.datasets import ArrayDataset, dataset_info, load_dataset
from edgefleet.task.local import load_local_data
from edgefleet.task.models import build_model
from edgefleet.task.names import ACCELERATORS
from edgefleet.task.partition import group_partition_indices, partition_indices, split_local
from edgefleet.task.train import seed_for

if TYPE_CHECKING:
    from edgefleet.pruning.submodel import PruningPlan


class NodeConfigError(SettingError):
    """A SuperNode's ``--node-config`` is missing a key or has a bad value."""


@dataclass(frozen=True)
class DeviceProfile:
    """The node-level facts a device reports. In simulation Flower sets only
    ``partition-id`` and ``num-partitions``; the rest derive from them and the run config.
    On a SuperNode, ``--node-config`` may set ``device-id``, ``capacity``, ``harvest-prob``,
    ``energy-source``, ``trace-path``, ``keep-ratio`` (CA-HFP's resource class),
    ``data-path`` (the device's own data instead of a partition of the run's data set) and
    ``accelerator`` (``auto``, ``cpu``, ``cuda``, ``mps``; default: the run config's)."""

    partition_id: int
    num_partitions: int
    device_id: int
    capacity: float = 10.0
    harvest_prob: float = 0.5
    energy_source: str = "bernoulli"
    trace_path: str = ""
    keep_ratio: float = 1.0
    data_path: str = ""
    accelerator: str = "auto"

    @classmethod
    def from_configs(cls, node_config: Mapping[str, Any], cfg: RunConfig) -> DeviceProfile:
        base = cls.from_node_config(node_config)
        e = cfg.energy
        prob = (
            e.harvest_probs[base.partition_id % len(e.harvest_probs)]
            if e.harvest_probs
            else e.harvest_prob
        )
        try:
            profile = cls(
                base.partition_id,
                base.num_partitions,
                base.device_id,
                capacity=float(node_config.get("capacity", e.capacity)),
                harvest_prob=float(node_config.get("harvest-prob", prob)),
                energy_source=str(node_config.get("energy-source", e.source)),
                trace_path=str(node_config.get("trace-path", "")),
                keep_ratio=float(
                    node_config.get("keep-ratio", cfg.pruning.ratio_for(base.partition_id))
                ),
                data_path=str(node_config.get("data-path", "")),
                accelerator=str(node_config.get("accelerator", cfg.train.accelerator)),
            )
        except (TypeError, ValueError) as err:
            raise NodeConfigError(f"node config energy or keep-ratio keys: {err}") from None
        if profile.accelerator not in ACCELERATORS:
            raise NodeConfigError(
                f"node config accelerator={profile.accelerator!r}; valid choices: "
                f"{', '.join(ACCELERATORS)}"
            )
        if not 0.0 < profile.keep_ratio <= 1.0:
            raise NodeConfigError(f"keep-ratio={profile.keep_ratio} must be in (0, 1]")
        if profile.capacity < e.round_cost and profile.energy_source != "always-on":
            raise NodeConfigError(
                f"capacity={profile.capacity} is below one round's cost {e.round_cost} "
                "(energy.train-slots + 1): this device could never take part"
            )
        return profile

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> DeviceProfile:
        try:
            pid = int(node_config["partition-id"])
            n = int(node_config["num-partitions"])
        except KeyError as err:
            raise NodeConfigError(
                f"node config lacks {err.args[0]!r}; start the SuperNode with "
                "--node-config 'partition-id=I num-partitions=N' (and optionally device-id=D)"
            ) from None
        except (TypeError, ValueError):
            raise NodeConfigError(
                "node config 'partition-id' and 'num-partitions' must be integers, got "
                f"{node_config.get('partition-id')!r} and {node_config.get('num-partitions')!r}"
            ) from None
        if not 0 <= pid < n:
            raise NodeConfigError(
                f"node config partition-id={pid} must be in [0, num-partitions={n})"
            )
        return cls(pid, n, int(node_config.get("device-id", pid)))


@dataclass
class Device:
    profile: DeviceProfile
    config: RunConfig
    train_data: ArrayDataset
    test_data: ArrayDataset
    model: nn.Module  # on the device's accelerator: training and scoring follow it there

    @cached_property  # asked for by every status query of a sessions run
    def labels(self) -> list[int]:
        """The classes of the local training data (the server's per-session accuracy)."""
        return [int(c) for c in np.unique(self.train_data.y)]

    @cached_property  # built once per process, only in warm start's continuous mode
    def teacher(self) -> nn.Module:
        """A second copy of the model's architecture, for the Continuous baseline's KL term
        (the last session's model, frozen)."""
        return copy.deepcopy(self.model)

    @property
    def plan(self) -> PruningPlan:
        """CA-HFP's channel groups of this device's model: one per process and architecture
        (:func:`~edgefleet.pruning.submodel.plan_for`; imported only when pruning)."""
        # lazy: torch_pruning (pruning.submodel) only for devices that prune
        from edgefleet.pruning.submodel import plan_for

        return plan_for(self.config.train.model, self.config.data.dataset)


def is_present(cfg: RunConfig, profile: DeviceProfile, server_round: int) -> bool:
    """Whether the device takes part in ``server_round``: in the alternating-sessions
    scenario group ``s % groups`` is present in session s; otherwise a device that can
    answer is present (a real device that leaves simply goes offline)."""
    s = cfg.sessions
    if s.schedule != "alternate":
        return True
    session = (server_round - 1) // s.rounds
    return session % s.groups == profile.partition_id % s.groups


# Per process, the devices (and profiles) of one run config: a Ray actor serves many devices
# of one run; a warm worker (edgefleet.client.worker) serves one device over many runs, and
# must not keep every earlier run's data and model.
_DEVICES: dict[tuple[Any, ...], Device] = {}
_PROFILES: dict[tuple[Any, ...], tuple[RunConfig, DeviceProfile]] = {}
_cached_run: list[tuple[Any, ...]] = []  # the run config the caches hold


def _key(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> tuple[Any, ...]:
    run_key = tuple(sorted(run_config.items()))
    if [run_key] != _cached_run:  # another run config: forget the previous one's devices
        _DEVICES.clear()
        _PROFILES.clear()
        _cached_run[:] = [run_key]
    return (run_key, tuple(sorted(node_config.items())))


def get_profile(
    run_config: Mapping[str, Any], node_config: Mapping[str, Any]
) -> tuple[RunConfig, DeviceProfile]:
    """The parsed run config and the device profile, without data or model: a battery status
    query must stay light, or asking a large fleet for its batteries would load every
    partition. (A query that asks for the data's labels, as the sessions wrapper's does,
    builds the device.)"""
    key = _key(run_config, node_config)
    if key not in _PROFILES:
        cfg = parse_run_config(run_config)
        _PROFILES[key] = (cfg, DeviceProfile.from_configs(node_config, cfg))
    return _PROFILES[key]


def get_device(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> Device:
    """The cached :class:`Device` for this run config and node, built on first use."""
    key = _key(run_config, node_config)
    if key not in _DEVICES:
        _DEVICES[key] = _build_device(*get_profile(run_config, node_config))
    return _DEVICES[key]


def _build_device(cfg: RunConfig, profile: DeviceProfile) -> Device:
    # Resolved first: a device asked for an accelerator it lacks fails before loading data.
    accelerator = resolve_accelerator(profile.accelerator)
    torch.set_num_threads(cfg.train.client_threads)
    if profile.data_path:
        # A real device's own data: no partitioning, the run's shapes and normalisation, and
        # the run's data set itself need not be on the device.
        info = dataset_info(cfg.data.dataset)
        local_train, local_test = split_local(
            load_local_data(profile.data_path, cfg.data.dataset),
            cfg.data.local_test_fraction,
            seed=seed_for(cfg.seed, profile.partition_id),
        )
        model = build_model(cfg.train.model, info.input_shape, info.num_classes)
        return Device(profile, cfg, local_train, local_test, model.to(accelerator))
    train_pool, _, info = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    if cfg.sessions.schedule == "alternate":
        idx = group_partition_indices(
            train_pool.y,
            profile.num_partitions,
            profile.partition_id,
            cfg.sessions.groups,
            cfg.sessions.label_overlap,
            cfg.data.alpha,
            seed=cfg.seed,
        )
    else:
        idx = partition_indices(
            train_pool.y,
            profile.num_partitions,
            profile.partition_id,
            cfg.data.partition,
            alpha=cfg.data.alpha,
            shards_per_partition=cfg.data.shards_per_device,
            seed=cfg.seed,
        )
    local_train, local_test = split_local(
        train_pool.subset(idx),
        cfg.data.local_test_fraction,
        seed=seed_for(cfg.seed, profile.partition_id),
    )
    model = build_model(cfg.train.model, info.input_shape, info.num_classes)
    return Device(profile, cfg, local_train, local_test, model.to(accelerator))
