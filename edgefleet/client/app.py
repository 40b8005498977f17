"""EdgeFleet's ClientApp: one ``train`` and one ``evaluate`` handler.

Replies carry exactly one ArrayRecord (``arrays``) and one MetricRecord (``metrics``) with
the same keys from every device, since Flower's strategies reject anything else. A device
that cannot do the work replies with an ``Error``, which the server counts as declined.
"""

from __future__ import annotations

import time

from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edgefleet.client.device import get_device
from edgefleet.task.train import evaluate as evaluate_model
from edgefleet.task.train import get_arrays, seed_for, set_arrays, train_local

app = ClientApp()

# Error codes in client replies; the server logs the reason either way.
ERR_BAD_CONFIG = 10
ERR_TRAIN_FAILED = 11


@app.train()
def train(msg: Message, context: Context) -> Message:
    try:
        device = get_device(context.run_config, context.node_config)
    except (ValueError, FileNotFoundError) as err:
        return Message(Error(ERR_BAD_CONFIG, str(err)), reply_to=msg)
    cfg, profile = device.config, device.profile
    config = msg.content.config_records["config"]
    server_round = int(config["server-round"])  # type: ignore[arg-type]
    mu = float(config.get("proximal-mu", 0.0))  # type: ignore[arg-type]
    set_arrays(device.model, msg.content.array_records["arrays"])
    start = time.perf_counter()
    try:
        result = train_local(
            device.model,
            device.train_data,
            steps=cfg.train.local_steps,
            batch_size=cfg.train.batch_size,
            lr=cfg.train.lr,
            momentum=cfg.train.momentum,
            seed=seed_for(cfg.seed, profile.partition_id, server_round),
            proximal_mu=mu,
        )
    except ValueError as err:
        return Message(Error(ERR_TRAIN_FAILED, str(err)), reply_to=msg)
    metrics = MetricRecord(
        {
            "num-examples": result.num_examples,
            "train-loss": result.loss,
            "device-id": profile.device_id,
            "energy-spent": 0.0,
            "train-time-s": time.perf_counter() - start,
        }
    )
    content = RecordDict({"arrays": get_arrays(device.model), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    try:
        device = get_device(context.run_config, context.node_config)
    except (ValueError, FileNotFoundError) as err:
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
