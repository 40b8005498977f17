"""How long does a simulated device's first build take, on a cold and on a warm machine?

Each sample is a fresh Python process (as a Ray actor is) that imports the ClientApp
(``edgefleet.client.app``) and then builds its first device with
``edgefleet.client.device.get_device`` for partition 0 of ``--partitions``: parse the run
config, load the data set, fit or read the partition, split it, build the model. That is
the work each actor does before it can answer its first message.

- ``cold``: an empty data cache (``EDGEFLEET_CACHE_DIR`` is a fresh folder): decodes and the
  partition fit happen.
- ``warm``: a second process on the same cache folder: on a machine that has run this
  configuration before.

``--compare-root PATH`` also measures another checkout (e.g. the commit before the on-disk
partition cache, from ``git archive``), its samples interleaved with this one's so that both
see the same load on a shared machine. Reported per checkout and state: the medians over
``--repeats`` of ``import_s`` (importing the ClientApp) and ``first_build_s`` (the first
``get_device``), and whether ``datasets`` / ``flwr_datasets`` were imported. ``loadavg``
(start, end) says how busy the machine was. Prints one JSON line on stdout; progress goes to
stderr. Example::

    .venv/bin/python -m benchmarks.perf.device_build --repeats 5 --compare-root /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import edgefleet.client.app  # noqa: F401  (what a ClientApp process imports first)
t1 = time.perf_counter()
from edgefleet.client.device import get_device
from edgefleet.config import DEFAULTS
run_config = {**DEFAULTS, **json.loads(sys.argv[1])}
t2 = time.perf_counter()
device = get_device(run_config, {"partition-id": 0, "num-partitions": int(sys.argv[2])})
t3 = time.perf_counter()
print(json.dumps({
    "import_s": t1 - t0,
    "first_build_s": t3 - t2,
    "train_samples": len(device.train_data),
    "datasets_imported": "datasets" in sys.modules,
    "flwr_datasets_imported": "flwr_datasets" in sys.modules,
}))
"""


def probe(code_root: Path, cache: Path, overrides: dict[str, Any], partitions: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code_root), "EDGEFLEET_CACHE_DIR": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(overrides), str(partitions)],
        env=env,
        cwd=code_root,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(samples: list[dict]) -> dict[str, Any]:
    return {
        "import_s": round(statistics.median(s["import_s"] for s in samples), 3),
        "first_build_s": round(statistics.median(s["first_build_s"] for s in samples), 3),
        "first_build_s_all": [round(s["first_build_s"], 3) for s in samples],
        "datasets_imported": any(s["datasets_imported"] for s in samples),
        "flwr_datasets_imported": any(s["flwr_datasets_imported"] for s in samples),
        "train_samples": samples[0]["train_samples"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--partitions", type=int, default=10, help="num-partitions (devices)")
    p.add_argument("--dataset", default="mnist-5k")
    p.add_argument("--data-dir", default="")
    p.add_argument("--partition", default="dirichlet", help="iid, dirichlet, shards")
    p.add_argument("--compare-root", type=Path, help="another checkout to measure alongside")
    args = p.parse_args(argv)
    overrides = {"dataset": args.dataset, "data-dir": args.data_dir, "partition": args.partition}
    roots = {"this": ROOT}
    if args.compare_root:
        roots["compare"] = args.compare_root.resolve()
    samples: dict[str, dict[str, list[dict]]] = {r: {"cold": [], "warm": []} for r in roots}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="device-build-") as tmp:
        for i in range(args.repeats):
            for name, root in roots.items():
                cache = Path(tmp) / f"{name}-{i}"
                for state in ("cold", "warm"):
                    s = probe(root, cache, overrides, args.partitions)
                    samples[name][state].append(s)
                    print(f"{name} {state} {i}: {s}", file=sys.stderr)
    result: dict[str, Any] = {
        "benchmark": "device_build",
        "dataset": args.dataset,
        "partition": args.partition,
        "partitions": args.partitions,
        "repeats": args.repeats,
        "loadavg": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
    }
    for name, root in roots.items():
        result[name] = {"root": str(root)} | {
            state: summarise(s) for state, s in samples[name].items()
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
