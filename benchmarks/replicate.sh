#!/usr/bin/env bash
# Small-scale replication of the paper's comparison on one H200, run through the package's own
# `sweep` and `compare` as a user would. Every run uses configs/replication/base.yaml (400 steps of 16 x 1024
# tokens) plus one method overlay from configs/methods/; all runs carry the sweep id `rep`. From the
# repository root on the GPU machine:
#   benchmarks/replicate.sh lr                  # baseline at lr 1e-3, 2e-3, 4e-3, seed 1, side by side
#   benchmarks/replicate.sh pick-lr             # prints the lr with the lowest tail-mean of `lr` (rule below)
#   LR=1e-3 benchmarks/replicate.sh runs NAME POINT...   # POINTs one after another into the store NAME
#   LR=1e-3 SEEDS="1 2" benchmarks/replicate.sh methods  # = runs methods baseline:S mhar:S single-head:S hc:S
#   LR=1e-3 SEEDS=1 HEADS="2 4 16" benchmarks/replicate.sh heads   # = runs heads h2:S h4:S h16:S
#   LR=1e-3 benchmarks/replicate.sh speed       # short solo throughput runs (80 steps, no validation)
#   benchmarks/replicate.sh compare             # compare table of every store
# A POINT is METHOD:SEED with METHOD one of baseline, hc, single-head, mhar (configs/methods/*.yaml) or hN
# (mhar.yaml with N routing heads). Anything after `--` is passed on to every `fit`.
#
# Stores: MLflow allows one writer per sqlite store, so every group of runs that runs beside others gets its
# own store, $RESULTS/mlflow-NAME.db, and `compare` writes $RESULTS/NAME.txt/.json for each. `compare` pairs
# runs of the same seed and lr (across stores too when given several --tracking-uri); benchmarks/plot_heads.py
# pairs across all stores by the same rule.
#
# Environment:
#   RESULTS   default benchmarks/results/replication     WORK    scratch (data cache), default /tmp/mhar_replication
#   PYTHON    default python3                            LR      peak lr of runs/methods/heads/speed (default 1e-3)
#   FIT_ARGS  extra fit arguments (word-split), before those after `--`
#   DEADLINE  epoch seconds: a run whose estimated end lies past it is not started ("SKIPPED" says so). The
#             estimate is a per-method time (est below) times SLOW_PCT/100; after each run SLOW_PCT becomes
#             the ratio of that run's wall time to its estimate (so it follows the contention of side-by-side runs).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${RESULTS:-$REPO/benchmarks/results/replication}
WORK=${WORK:-/tmp/mhar_replication}
PY=${PYTHON:-python3}
LR=${LR:-1e-3}  # the lr tune of 2026-12-02 picked 1e-3 (docs/replication.md)
SEEDS=${SEEDS:-1 2}
HEADS=${HEADS:-2 4 16}
LRS=${LRS:-1e-3 2e-3 4e-3}
SLOW_PCT=${SLOW_PCT:-100}
SWEEP=${SWEEP:-rep}
BASE=$REPO/configs/replication/base.yaml
M=$REPO/configs/methods
mkdir -p "$RESULTS" "$WORK"
RESULTS=$(cd "$RESULTS" && pwd)
cd "$WORK"  # never import mhar_lit from the repository root by accident (PYTHONPATH decides)
STAGE=${1:-}
shift || true
ARGS=() EXTRA=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; EXTRA=("$@"); break; fi
  ARGS+=("$1"); shift
done
COMMON=(--data.cache_dir "$WORK/data_cache")
# shellcheck disable=SC2206
[[ -n ${FIT_ARGS:-} ]] && EXTRA=($FIT_ARGS "${EXTRA[@]}")  # FIT_ARGS: extra fit args from the environment

# estimated seconds of one 400-step run alone on the H200, start-up included (first pass, scaled to 400 steps)
est() { case $1 in baseline) echo 50 ;; hc) echo 95 ;; *) echo 65 ;; esac; }

grid() {  # grid METHOD SEED -> the --grid arguments of one point
  local method=$1 seed=$2
  case $method in
    h[0-9]*) echo "--grid config=$M/mhar.yaml --grid model.residual.init_args.heads=${method#h}" ;;
    baseline|hc|single-head|mhar) echo "--grid config=$M/$method.yaml" ;;
    *) echo "unknown method $method" >&2; return 1 ;;
  esac
  echo "--grid model.lr=$LR --grid seed_everything=$seed"
}

point() {  # point EST_SECONDS GRID_ARGS...: one sweep point into $MLFLOW_TRACKING_URI, unless the deadline says no
  local est=$1; shift
  if [[ -n ${DEADLINE:-} ]] && (( $(date +%s) + est * SLOW_PCT / 100 > DEADLINE )); then
    echo "SKIPPED (deadline) $* (estimate ${est}s x ${SLOW_PCT}%)"; return 0
  fi
  local t0 wall; t0=$(date +%s)
  $PY -m mhar_lit sweep --config "$BASE" --sweep-id "$SWEEP" --keep-going "$@" -- "${COMMON[@]}" "${EXTRA[@]}" \
    || echo "FAILED $*"
  wall=$(( $(date +%s) - t0 ))
  SLOW_PCT=$(( wall * 100 / est > 100 ? wall * 100 / est : 100 ))
  echo "WALL ${wall}s $* (started $t0, est ${est}s)"
}

runs() {  # runs STORE POINT...
  local store=$1 p; shift
  export MLFLOW_TRACKING_URI=sqlite:///$RESULTS/mlflow-$store.db
  for p in "$@"; do
    # shellcheck disable=SC2046
    point "$(est "${p%%:*}")" $(grid "${p%%:*}" "${p##*:}")
  done
}

compare_store() {  # compare_store STORE
  MLFLOW_TRACKING_URI=sqlite:///$RESULTS/mlflow-$1.db $PY -m mhar_lit compare --sweep "$SWEEP" \
    --json "$RESULTS/$1.json" > "$RESULTS/$1.txt" 2> "$WORK/compare-$1.err" || echo "COMPARE FAILED $1"
}

case "$STAGE" in
  lr)
    for lr in $LRS; do
      mkdir -p "$WORK/lr-$lr"
      (cd "$WORK/lr-$lr" && export MLFLOW_TRACKING_URI=sqlite:///$RESULTS/mlflow-lr-$lr.db &&
        point "$(est baseline)" --grid "config=$M/baseline.yaml" --grid "model.lr=$lr" --grid seed_everything=1 \
          > "$WORK/lr-$lr.log" 2>&1) &
    done
    wait
    for lr in $LRS; do grep -E "^(WALL|SKIPPED|FAILED)" "$WORK/lr-$lr.log" || true; compare_store "lr-$lr" & done
    wait ;;
  pick-lr)
    # The rule, fixed before the runs: the lr with the lowest tail-mean validation loss of the baseline at
    # seed 1; failed or NaN runs are left out; no valid run at all falls back to 2e-3. No tie margin.
    $PY - "$RESULTS" $LRS <<'EOF'
import json, math, sys
results, lrs = sys.argv[1], sys.argv[2:]
best = None
for lr in lrs:
    try:
        rows = json.load(open(f"{results}/lr-{lr}.json"))["rows"]
    except (OSError, ValueError, KeyError):
        continue
    for r in rows:
        t = r.get("tail_mean")
        if r.get("status") == "FINISHED" and t is not None and not math.isnan(t) and (best is None or t < best[1]):
            best = (lr, t)
print(best[0] if best else "2e-3")
EOF
    ;;
  runs)
    runs "${ARGS[@]}" ;;
  methods)
    pts=(); for s in $SEEDS; do pts+=("baseline:$s" "mhar:$s" "single-head:$s" "hc:$s"); done
    runs methods "${pts[@]}"; compare_store methods; cat "$RESULTS/methods.txt" ;;
  heads)
    pts=(); for s in $SEEDS; do for h in $HEADS; do pts+=("h$h:$s"); done; done
    runs heads "${pts[@]}"; compare_store heads; cat "$RESULTS/heads.txt" ;;
  speed)
    # Throughput only: each method alone on the GPU for 80 steps, no validation; tokens/s over 20-step windows.
    SWEEP=rep-speed EXTRA+=(--trainer.max_steps 80 --trainer.limit_val_batches 0)
    est() { case $1 in hc) echo 30 ;; *) echo 25 ;; esac; }
    runs speed baseline:1 mhar:1 single-head:1 hc:1; compare_store speed ;;
  compare)
    shopt -s nullglob  # no store yet (every run skipped): nothing to compare, not a store named "*"
    for db in "$RESULTS"/mlflow-*.db; do
      store=$(basename "$db" .db); store=${store#mlflow-}
      if [[ $store == speed ]]; then SWEEP=rep-speed compare_store "$store" & else compare_store "$store" & fi
    done
    wait ;;
  *) echo "usage: $0 lr|pick-lr|runs|methods|heads|speed|compare [ARGS] [-- extra fit args]" >&2; exit 2 ;;
esac
