#!/usr/bin/env bash
# CA-HFP on CIFAR-10 (issue 27: long enough for the full model to pass 60 %), sized for one
# 10-minute call on a lent GPU machine (an H200 with 16 cores ran it: the results file
# benchmarks/results/pruning_claims-cifar10-124r-h200-2026-12-04.json). The 6 variants x 2
# seeds run as 12 processes at once (pruning_claims.py --jobs 12 --workers 1); the rounds are
# sized by a 3-round calibration of the same 12 runs so that all of them end by DEADLINE
# seconds. Any machine runs it (on 2 CPU cores a round of the 12 takes minutes, not seconds).
#
# The device machine reaches no package index, and its Python (3.12) has torch and
# torchvision but not Flower: before the call, from the repository root here,
#   echo /.whl/ >> .git/info/exclude; echo /.gpujob/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     flwr==1.42.0 flwr-datasets==0.6.1 datasets dill multiprocess torch-pruning==1.6.1 \
#     iterators pycryptodome cryptography cffi pycparser grpcio grpcio-health-checking \
#     protobuf tomli tomli_w pydantic pydantic_core annotated-types typing_extensions \
#     typing-inspection fastapi starlette sqlalchemy greenlet alembic mako uvicorn \
#     prompt_toolkit wcwidth typer click shellingham
#   mkdir -p .gpujob/data && cp ../shared/data/cifar10-jpg.tar.gz .gpujob/data/
#   git rev-parse HEAD > .gpujob/COMMIT    # the line's git_commit (clean tree)
# then run `bash benchmarks/device/pruning_cifar10.sh` there with .whl and .gpujob carried;
# $OUT gets the line (pruning_claims.json), the log and the runs' metrics (runs.tgz).
# Locally, for a dry run: OUT=/tmp/o SKIP_PIP=1 PY=.venv/bin/python TMPD=/tmp/d JOBS=2
#   DEADLINE=150 EXTRA="--variants full,curvature --seeds 0" bash benchmarks/device/...
set -u
cd "$(dirname "$0")/../.."
DEADLINE=${DEADLINE:-530}
PY=${PY:-python3}
TMPD=${TMPD:-/tmp}
exec > >(tee "$OUT/log.txt") 2>&1
echo "start $(date -u +%FT%TZ)"
[ -n "${SKIP_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || { echo PIP-FAILED; exit 1; }
export PYTHONPATH=/tmp/site:$PWD EDGEFLEET_CACHE_DIR=/tmp/efcache
export BENCHMARK_GIT_COMMIT=$(cat .gpujob/COMMIT)  # git rev-parse HEAD here, +dirty if so
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
nvidia-smi -L; nproc; free -g | head -2
$PY - <<'PY' || { echo IMPORT-FAILED; exit 1; }
import torch, torchvision, flwr, torch_pruning
print("torch", torch.__version__, "tv", torchvision.__version__, "flwr", flwr.__version__, "cuda", torch.cuda.is_available())
import edgefleet.simulation.inprocess, edgefleet.client.app, edgefleet.server.app
from edgefleet.pruning.submodel import plan_for
print("plan groups", len(plan_for("resnet8", "cifar10").groups))
PY
$PY -c "import datasets; print('datasets', datasets.__version__)" 2>&1 | tail -1
ARGS=(--dataset cifar10 --model resnet8 --alphas 0.1 --seeds 0,1 --devices 4
      --local-steps 25 --batch-size 64 --engine inprocess --data-dir .gpujob/data
      --workers 1 --jobs ${JOBS:-12} ${EXTRA:-})
echo "calibration at $SECONDS s"
timeout 240 $PY -m benchmarks.claims.pruning_claims "${ARGS[@]}" --rounds 3 --out $TMPD/calib > "$OUT/calib.json"
rc=$?
echo "calibration rc $rc at $SECONDS s"
if [ $rc != 0 ]; then
    for f in $TMPD/calib/cells/cell-0.log $TMPD/calib/*/flower.log; do echo "== $f"; tail -30 "$f"; done 2>/dev/null | tail -80
    exit 1
fi
R=$($PY - "$DEADLINE" "$SECONDS" "$TMPD" <<'PY'
import json, glob, sys
deadline, now = float(sys.argv[1]), float(sys.argv[2])
per_round, first = [], []
for f in glob.glob(sys.argv[3] + "/calib/*/metrics.jsonl"):
    w = [json.loads(l)["wall_s"] for l in open(f)]
    per_round.append((w[-1] - w[0]) / (len(w) - 1)); first.append(w[0])
t, f0 = max(per_round), max(first)
budget = deadline - now - f0 - 40  # the children's start-up and the parent's plots
r = int(0.85 * budget / t)
print(max(10, min(r, 500)))
print(f"per round {t:.2f} s (slowest of {len(per_round)}), round 1 {f0:.1f} s -> {r}", file=sys.stderr)
PY
)
echo "rounds $R at $SECONDS s"
timeout $((DEADLINE + 30 - SECONDS)) $PY -m benchmarks.claims.pruning_claims "${ARGS[@]}" --rounds "$R" --out $TMPD/main > "$OUT/pruning_claims.json"
echo "main rc $? at $SECONDS s"
tail -c 600 "$OUT/pruning_claims.json"
tar -czf "$OUT/runs.tgz" -C $TMPD main/cells $(cd $TMPD && ls -d main/cifar10-*/ 2>/dev/null | sed 's|$|metrics.jsonl|') 2>/dev/null
tar -czf "$OUT/calib.tgz" --exclude='*.npz' -C $TMPD calib 2>/dev/null
ls -la "$OUT"
