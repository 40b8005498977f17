"""Ray's head is started again when its raylet missed ``ray start``'s fixed 30 s window to
register (a loaded machine), and only then: stand-in heads, no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefleet.processes import RAY_NODE_TIMED_OUT, RAY_STARTED, FleetError, FlowerFleet

# A stand-in for `ray start --head --block`: each start appends to a counter file; the
# first ``fails`` starts print Ray's time-out and exit 1, later ones start and block.
HEAD = f"""
import sys, time
from pathlib import Path
count, fails = Path(sys.argv[1]), int(sys.argv[2])
n = len(count.read_text()) if count.exists() else 0
count.write_text("x" * (n + 1))
if n < fails:
    print("Exception: The current node {RAY_NODE_TIMED_OUT}. This could happen", flush=True)
    sys.exit(1)
print("{RAY_STARTED}", flush=True)
time.sleep(60)
"""


def _fleet(tmp_path: Path, fails: int, message: str = HEAD) -> FlowerFleet:
    fleet = FlowerFleet(tmp_path)
    script = tmp_path / "head.py"  # a file: the log's first line is the command
    script.write_text(message)
    args = ["python", str(script), str(tmp_path / "starts"), str(fails), "--temp-dir=/tmp/x"]
    fleet._ray_head_start = (args, dict(fleet.env))
    fleet._ray_head = fleet.start("ray-head", args, env=dict(fleet.env))
    fleet.ray_address, fleet._ray_timeout = "127.0.0.1:1", 30.0
    return fleet


@pytest.mark.parametrize("fails", [0, 2])
def test_a_head_that_timed_out_registering_is_started_again(
    tmp_path: Path, fails: int, capfd: pytest.CaptureFixture[str]
) -> None:
    fleet = _fleet(tmp_path, fails)
    try:
        fleet.wait_for_ray()
        assert fleet._ray_head is not None and fleet._ray_head.running()
        assert (tmp_path / "starts").read_text() == "x" * (fails + 1)
        assert capfd.readouterr().err.count("starting it again") == fails
    finally:
        fleet.stop()


def test_it_gives_up_after_three_attempts_and_never_retries_another_failure(
    tmp_path: Path,
) -> None:
    fleet = _fleet(tmp_path, fails=5)
    try:
        with pytest.raises(FleetError, match="exited with code 1"):
            fleet.wait_for_ray()
        assert (tmp_path / "starts").read_text() == "xxx"
    finally:
        fleet.stop()
    (tmp_path / "o").mkdir()
    other = _fleet(tmp_path / "o", fails=0, message="import sys; sys.exit(3)")
    try:
        with pytest.raises(FleetError, match="exited with code 3"):
            other.wait_for_ray()
    finally:
        other.stop()
