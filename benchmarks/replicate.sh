#!/usr/bin/env bash
# Small-scale replication of the paper's comparison on one H200 (issue 8), run through the package's own
# `sweep` and `compare` exactly as a user would. Usage (from the repository root, on the GPU machine):
#   benchmarks/replicate.sh methods   # baseline / HC (n=4, dynamic) / single-head / MHAR H=8, seeds 1 and 2
#   benchmarks/replicate.sh heads     # MHAR with H = 1, 2, 4, 8, 16, seed 1
# Writes the MLflow store and compare tables to $RESULTS (default benchmarks/results/replication).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${RESULTS:-$REPO/benchmarks/results/replication}
WORK=${WORK:-/tmp/mhar_replication}
PY=${PYTHON:-python3}
mkdir -p "$RESULTS" "$WORK"
cd "$WORK"
M=$REPO/configs/methods
case "${1:-methods}" in
  methods)
    ID=rep-methods
    $PY -m mhar_lit sweep --config "$REPO/configs/replication/base.yaml" --sweep-id $ID --keep-going \
      --grid "config=$M/baseline.yaml,$M/hc.yaml,$M/single-head.yaml,$M/mhar.yaml" \
      --grid seed_everything=1,2 "${@:2}" ;;
  heads)
    ID=rep-heads
    $PY -m mhar_lit sweep --config "$REPO/configs/replication/base.yaml" --sweep-id $ID --keep-going \
      --grid "config=$M/mhar.yaml" --grid model.residual.init_args.heads=1,2,4,8,16 \
      --grid seed_everything=1 "${@:2}" ;;
  *) echo "usage: $0 methods|heads [-- extra fit args]" >&2; exit 2 ;;
esac
$PY -m mhar_lit compare --sweep $ID --json "$RESULTS/$ID.json" | tee "$RESULTS/$ID.txt"
cp mlflow.db "$RESULTS/mlflow-$ID.db"
