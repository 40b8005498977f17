"""``metrics.jsonl`` rows read back typed (:class:`~edgefleet.server.results.MetricsRow`): each
component's section comes back as the dataclass it was written from, so readers (the run's
story, the session summary) use attributes, not column strings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from edgefleet.loop.context import (
    PruningRow,
    RoundContext,
    ScreeningRow,
    SelectionRow,
    SessionRow,
    StoppingRow,
)
from edgefleet.loop.registry import DeviceRegistry
from edgefleet.loop.roundloop import RoundResult
from edgefleet.server.results import SECTIONS, MetricsRow, read_metrics, round_row
from tests.fakes import rec


def _result() -> RoundResult:
    ctx = RoundContext(7, DeviceRegistry())
    sel = ctx.section(SelectionRow)
    sel.status_queries, sel.selected, sel.deadline_skipped = 4, ["3", "1"], ["9"]
    ses = ctx.section(SessionRow)
    ses.present, ses.phase, ses.warm_start = 5, "aux", True
    ses.warmstart_weights, ses.session_accuracy = {"1": 0.75, "2": 0.25}, 0.9
    ctx.section(PruningRow).compact_replies = 2
    ctx.section(StoppingRow).task_vector_growth = 0.01
    ctx.section(ScreeningRow).missing = ["node-4"]
    result = RoundResult(7, 3, rec(w=np.zeros(2)), ["3", "1"], ["5"], [], 10, 20, 1.5, {},
                         {"test_accuracy": 0.5}, 12.0, context=ctx)  # fmt: skip
    result.extra["my_column"] = "mine"
    return result


def test_a_row_reads_back_into_the_sections_it_was_written_from(tmp_path: Path) -> None:
    result = _result()
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(round_row(result)) + "\n")
    (row,) = read_metrics(path)
    assert (row.round, row.session, row.participants, row.declined) == (7, 3, ["3", "1"], ["5"])
    assert row.test_accuracy == 0.5 and row.energy_spent == 1.5 and row.evaluated is True
    for cls in (SelectionRow, SessionRow, PruningRow, StoppingRow, ScreeningRow):
        assert row.section(cls) == result.context.section(cls), cls.__name__
    assert row.extra == {"my_column": "mine"}  # a user's own column is kept, not lost


def test_an_absent_section_is_none_or_its_defaults() -> None:
    row = MetricsRow.parse({"round": 1, "session": 1, "participants": ["0"]})
    assert row.section(SessionRow) is None
    assert row.of(SessionRow).phase == "train" and row.of(SessionRow).session_accuracy is None
    assert row.of(StoppingRow).stopping_resting is None and row.test_accuracy is None


def test_every_column_belongs_to_one_section() -> None:
    # What makes a row readable back: no two sections (or a section and the loop's own
    # columns) write a column of the same name.
    owners: dict[str, str] = {}
    own = {f.name for f in dataclasses.fields(MetricsRow)} - {"sections", "extra"}
    for name in own:
        owners[name] = "MetricsRow"
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            assert f.name not in owners, f"{f.name}: {owners.get(f.name)} and {section.__name__}"
            owners[f.name] = section.__name__
    # ... and every key round_row writes is one of them.
    assert set(round_row(_result())) - {"my_column"} <= set(owners)


def test_every_row_section_is_read_back() -> None:
    from edgefleet.loop import context

    declared = {
        obj
        for name, obj in vars(context).items()
        if name.endswith("Row") and dataclasses.is_dataclass(obj)
    }
    assert declared == set(SECTIONS)
