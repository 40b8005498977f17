"""EdgeFleet's ClientApp: one ``train`` and one ``evaluate`` handler.

Train replies carry one ArrayRecord (``arrays``) and one MetricRecord (``metrics``) with the
same keys from every device, since Flower's strategies reject anything else; a device that
trains a CA-HFP submodel adds the ArrayRecord ``kept`` (its channels), which the server's
reconstruction wrapper consumes before the strategy sees the reply. A device that cannot do
the work replies with an ``Error``, which the server counts as declined.
"""

from __future__ import annotations

import time

from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edgefleet.client.battery import Battery, SourceUnavailableError
from edgefleet.client.device import DeviceProfile, get_device, get_profile, is_present
from edgefleet.client.energy import load_battery, save_battery
from edgefleet.client.faults import NODE_CONFIG_KEY, corrupt
from edgefleet.client.pruning import parameter_fraction, round_model
from edgefleet.config import RunConfig
from edgefleet.pruning.wire import KEPT, kept_record
from edgefleet.task.train import evaluate as evaluate_model
from edgefleet.task.train import get_arrays, seed_for, set_arrays, train_local

app = ClientApp()

# Error codes in client replies; the server logs the reason either way.
ERR_BAD_CONFIG = 10
ERR_TRAIN_FAILED = 11
ERR_NO_ENERGY = 12
ERR_ABSENT = 13


# What a device's configuration or battery can raise: each becomes an Error reply (the
# server counts the device as declined or unavailable) instead of a crashed ClientApp.
DEVICE_ERRORS = (ValueError, FileNotFoundError, SourceUnavailableError)


def _battery_at(msg: Message, context: Context, cfg: RunConfig, profile: DeviceProfile) -> Battery:
    """The device's battery advanced to the slot the server's message carries."""
    battery = load_battery(profile, cfg, context)
    battery.advance(int(msg.content.config_records["config"]["slot"]))  # type: ignore[arg-type]
    return battery


@app.query()
def status(msg: Message, context: Context) -> Message:
    """The light status query (energy-aware selection, sessions): advance the battery to the
    server's slot; report battery, feasibility, presence and, when asked (``labels`` in the
    config), the classes of the local data."""
    config = msg.content.config_records["config"]
    try:
        cfg, profile = get_profile(context.run_config, context.node_config)
        battery = _battery_at(msg, context, cfg, profile)
        labels = (
            get_device(context.run_config, context.node_config).labels
            if config.get("labels", 0)
            else []
        )
    except DEVICE_ERRORS as err:
        return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
    save_battery(battery, context)
    cost = cfg.energy.round_cost
    status: dict[str, int | float | list[int] | list[float]] = {
        "device-id": profile.device_id,
        "battery-level": battery.level,
        "feasible": int(battery.can_afford(cost)),
        "present": int(is_present(cfg, profile, int(config["server-round"]))),  # type: ignore[arg-type]
    }
    if labels:
        status["labels"] = labels
    return Message(RecordDict({"status": MetricRecord(status)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    try:
        device = get_device(context.run_config, context.node_config)
    except DEVICE_ERRORS as err:
        return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
    cfg, profile = device.config, device.profile
    config = msg.content.config_records["config"]
    server_round = int(config["server-round"])  # type: ignore[arg-type]
    mu = float(config.get("proximal-mu", 0.0))  # type: ignore[arg-type]
    if not is_present(cfg, profile, server_round):
        return Message(Error(ERR_ABSENT, "device is not present this session"), reply_to=msg)
    if len(device.train_data) == 0:  # decline before any energy is spent
        return Message(Error(ERR_TRAIN_FAILED, "no local training data"), reply_to=msg)
    energy = 0.0
    if "slot" in config:  # energy-aware selection: re-check the battery, spend only if able
        try:
            battery = _battery_at(msg, context, cfg, profile)
        except DEVICE_ERRORS as err:
            return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
        if not battery.can_afford(cfg.energy.round_cost):
            save_battery(battery, context)
            reason = f"battery {battery.level:.2f} < round cost {cfg.energy.round_cost:.0f}"
            return Message(Error(ERR_NO_ENERGY, reason), reply_to=msg)
        battery.spend(cfg.energy.round_cost)
        save_battery(battery, context)
        energy = cfg.energy.round_cost
    seed = seed_for(cfg.seed, profile.partition_id, server_round)
    start = time.perf_counter()
    try:
        model, kept = round_model(
            device, msg.content.array_records["arrays"], msg.content.array_records.get(KEPT), seed
        )
        result = train_local(
            model,
            device.train_data,
            steps=cfg.train.local_steps,
            batch_size=cfg.train.batch_size,
            lr=cfg.train.lr,
            momentum=cfg.train.momentum,
            seed=seed,
            proximal_mu=mu,
        )
    except ValueError as err:  # no data, or a compact download that does not fit
        return Message(Error(ERR_TRAIN_FAILED, str(err)), reply_to=msg)
    metrics = MetricRecord(
        {
            "num-examples": result.num_examples,
            "train-loss": result.loss,
            "device-id": profile.device_id,
            "energy-spent": energy,
            "train-time-s": time.perf_counter() - start,
            "kept-fraction": parameter_fraction(model, device.model),
        }
    )
    content = RecordDict({"arrays": get_arrays(model), "metrics": metrics})
    if kept is not None:  # a CA-HFP submodel: the server needs its channels to rebuild it
        content[KEPT] = kept_record(kept)
    fault = context.node_config.get(NODE_CONFIG_KEY)
    if fault:  # test-only: a device that lies, for the server's screening tests
        try:
            content = corrupt(content, str(fault), server_round)
        except ValueError as err:
            return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    try:
        device = get_device(context.run_config, context.node_config)
    except DEVICE_ERRORS as err:
        return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
    set_arrays(device.model, msg.content.array_records["arrays"])
    res = evaluate_model(device.model, device.test_data)
    metrics = MetricRecord(
        {
            "num-examples": len(device.test_data),
            "eval-loss": res.loss,
            "eval-accuracy": res.accuracy,
            "device-id": device.profile.device_id,
        }
    )
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
