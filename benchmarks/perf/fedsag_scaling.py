"""FedSAG aggregation cost as the fleet grows (EH-FedSAG issue, scaling claim).

For K = 100, 1,000 and 10,000 devices with 25 participants a round and SmallCNN-sized
parameters, time :meth:`SagaMemory.direction` (the whole server-side SAGA step: memory mean
from the running sum, corrections, memory replacement) per round, and report the server
memory. Every device uploads once during warm-up so that the table is full (the worst case
for memory); rounds are then timed. A round costs O(participants x parameters) thanks to the
running sum, so the time should not grow with K; memory grows as K x parameters.

    python -m benchmarks.perf.fedsag_scaling                      # K = 100,1000,10000
    python -m benchmarks.perf.fedsag_scaling --fleet 100,1000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from edgefleet.algorithms.saga import SagaMemory
from edgefleet.task.models import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fleet", default="100,1000,10000", help="comma-separated K")
    p.add_argument("--participants", type=int, default=25)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--model", default="smallcnn")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = build_model(args.model, (1, 28, 28), 10)
    dim = sum(t.numel() for t in model.state_dict().values())
    rng = np.random.default_rng(args.seed)
    deltas = rng.normal(0, 1e-3, size=(args.participants, dim)).astype(np.float32)

    results = []
    for k in (int(x) for x in args.fleet.split(",")):
        memory = SagaMemory(dim, initial_rows=k)  # sized up front: no copy when growing
        ids = [str(i) for i in range(k)]
        t0 = time.perf_counter()
        for start in range(0, k, args.participants):  # warm-up: every device uploads once
            batch = ids[start : start + args.participants]
            memory.direction({i: deltas[j % args.participants] for j, i in enumerate(batch)})
        warmup_s = time.perf_counter() - t0
        times = []
        for _ in range(args.rounds):
            chosen = rng.choice(k, size=min(args.participants, k), replace=False)
            updates = {ids[c]: deltas[j] for j, c in enumerate(chosen)}
            t = time.perf_counter()
            memory.direction(updates)
            times.append(time.perf_counter() - t)
        drift = float(np.abs(memory.mean() - memory.recompute_mean()).max())
        results.append(
            {
                "devices": k,
                "round_s_median": round(statistics.median(times), 5),
                "round_s_max": round(max(times), 5),
                "memory_bytes": memory.nbytes,
                "warmup_s": round(warmup_s, 2),
                "running_mean_max_abs_drift": drift,
            }
        )
        del memory
    base = results[0]["round_s_median"]
    print(
        json.dumps(
            {
                "benchmark": "fedsag_scaling",
                "sizes": {
                    "participants": args.participants,
                    "rounds": args.rounds,
                    "model": args.model,
                    "parameters": dim,
                    "memory_dtype": "float32",
                },
                "results": results,
                "time_ratio_largest_over_smallest": round(results[-1]["round_s_median"] / base, 3),
                "target_ratio": 1.2,
            }
        )
    )


if __name__ == "__main__":
    main()
