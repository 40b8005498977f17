"""The round loop's central evaluation skips a model it has just evaluated, whatever the
evaluate function (here EdgeFleet's own)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg

import edgefleet.server.app as server_app
import edgefleet.task.train as train
from edgefleet.config import parse_run_config
from edgefleet.loop.roundloop import RoundLoop
from edgefleet.task.models import build_model
from edgefleet.task.train import get_arrays, set_arrays
from tests.fakes import FakeGrid


def test_an_unchanged_model_is_not_evaluated_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = train.evaluate

    def counting(model, data):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(model, data)

    # central_evaluation imports evaluate when called (the ServerApp module loads without torch)
    monkeypatch.setattr(train, "evaluate", counting)
    central = server_app.central_evaluation(
        parse_run_config({"dataset": "digits", "model": "linear", "eval-samples": 50})
    )
    loop = RoundLoop(FedAvg(), FakeGrid({}), evaluate_fn=central.evaluate)  # type: ignore[arg-type]
    first = loop.evaluate(1, central.initial)
    again = loop.evaluate(2, central.initial)  # a round in which nothing was aggregated
    assert again == first and len(calls) == 1
    # another record is evaluated
    model = build_model("linear", (1, 8, 8), 10)
    set_arrays(model, central.initial)
    for p in model.parameters():
        p.data.mul_(0.0)
    changed = loop.evaluate(3, get_arrays(model))
    assert len(calls) == 2
    assert changed["test_loss"] == pytest.approx(np.log(10), rel=1e-6)  # zero logits
