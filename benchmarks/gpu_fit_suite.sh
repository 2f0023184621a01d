#!/usr/bin/env bash
# One device call (at most 10 minutes): a peer trainer's step against our baseline's (benchmarks/peer_step.py:
# litgpt eager and captured-ours at 100M / 350M / 1B, then litgpt under torch.compile) and the shipped recipes of
# ONE size through `python -m mhar_lit fit` (benchmarks/fit_throughput.py: baseline, mhar, block-mhar, 3 repeats
# each, interleaved). From the repository root, with .whl (../shared/tools/gpu-wheels.sh) and .whl_peer
# (benchmarks/gpu_wheels_peer.sh) carried:
#
#   bash benchmarks/gpu_fit_suite.sh SIZE [COMMIT] [--no-peer] [--fused-check] [--methods "M ..."] [--repeats N]
#                                    [--variant NAME=OVERRIDES ...] [-- FIT OVERRIDES...]
#     SIZE    100M, 350M or 1B
#     COMMIT  the commit of the copied tree (the device's copy has no usable git history); recorded as stated
#     --no-peer   skip peer_step.py: the fits get the whole call (350M and 1B need it: ~9 fits of 40-60 s)
#     --fused-check  first benchmarks/fused_loss_check.py at SIZE (fused vs plain loss: numerics, capture, ms, GiB)
#     --methods   of baseline mhar block (default all three); --repeats N (default 3)
#     --variant NAME=OVERRIDES  repeatable: fit_throughput.py --variants, e.g. the fused loss and the precisions:
#                 --variant bf16-true= --variant fused=--model.fused_loss=true --variant mixed=--trainer.precision=bf16-mixed
#     FIT OVERRIDES  appended to every fit, e.g. -- --model.cuda_graph true
#   With .whl_fused (benchmarks/gpu_wheels_fused.sh) carried, its wheels are installed too (needed by fused_loss).
#
#   bash benchmarks/gpu_fit_suite.sh --print-call SIZE [ARGS...]   (here, not on the device) checks the tree is
#     committed and the wheel folders exist, and prints the `run` call with this checkout's commit.
#
# $OUT receives at most 8 files: env.txt, peer_step.json, peer_compile.json, peer_step.log, fit_SIZE.json,
# fit_SIZE.log, fits.tgz (every fit's log and MLflow store) and, with --fused-check, fused_loss_check.json.
# Join the sizes' fit_SIZE.json (and a peer report) with fit_throughput.py --merge.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--print-call" ]]; then
  shift
  [[ -n "${1:-}" ]] || { echo "usage: $0 --print-call SIZE [--no-peer] [-- FIT OVERRIDES]" >&2; exit 2; }
  if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
    echo "the tree has uncommitted changes: commit them first (the call measures the committed code)" >&2; exit 1
  fi
  folders=(.whl .whl_peer)
  [[ "$*" == *fused* ]] && folders+=(.whl_fused)
  for d in "${folders[@]}"; do
    ls "$d"/*.whl > /dev/null 2>&1 || { echo "$d/ has no wheels: run ../shared/tools/gpu-wheels.sh .whl," \
      "benchmarks/gpu_wheels_peer.sh .whl_peer and benchmarks/gpu_wheels_fused.sh .whl_fused here first" >&2; exit 1; }
  done
  size=$1; shift
  args=""; (( $# )) && args=$(printf ' %q' "$@")
  carry=$(printf '"%s", ' "${folders[@]}")
  echo "run(command='bash benchmarks/gpu_fit_suite.sh $size $(git rev-parse HEAD)$args', carry=[${carry%, }], timeout_s=600)"
  echo "travels: $(du -sch "${folders[@]}" | tail -1 | cut -f1) of wheels plus the tree"
  exit 0
fi

SIZE=${1:?usage: bash benchmarks/gpu_fit_suite.sh SIZE [COMMIT] [--no-peer] [-- FIT OVERRIDES]}; shift
COMMIT=""; PEER=1; FUSED_CHECK=0; METHODS="baseline mhar block"; REPEATS=3; VARIANTS=(); EXTRA=()
while (( $# )); do
  case "$1" in
    --no-peer) PEER=0 ;;
    --fused-check) FUSED_CHECK=1 ;;
    --methods) METHODS=${2:?--methods needs a value}; shift ;;
    --repeats) REPEATS=${2:?--repeats needs a value}; shift ;;
    --variant) VARIANTS+=("${2:?--variant needs NAME=OVERRIDES}"); shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) [[ "$1" =~ ^[0-9a-f]{7,40}$ ]] || { echo "unknown argument $1" >&2; exit 2; }; COMMIT=$1 ;;
  esac
  shift
done
case "$SIZE" in 100M|350M|1B) ;; *) echo "SIZE must be 100M, 350M or 1B, got $SIZE" >&2; exit 2 ;; esac
OUT=${OUT:?OUT must name the folder for the results}
WORK=/tmp/fit_suite
mkdir -p "$WORK" "$OUT"

WHEELS=(.whl/*.whl .whl_peer/*.whl)
ls .whl_fused/*.whl > /dev/null 2>&1 && WHEELS+=(.whl_fused/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${WHEELS[@]}" && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true
T0=$(date +%s)
BUDGET=560  # seconds from here; install and the tar at the end take the rest of the 600
left() { echo $(( T0 + $1 - $(date +%s) )); }  # seconds until second $1 of the budget

(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
 python3 -c "import sys, torch, triton, lightning; print(sys.version.split()[0], torch.__version__, triton.__version__, lightning.__version__)"
 echo "commit (stated): ${COMMIT:-none}"; echo "suite: $SIZE peer=$PEER fused_check=$FUSED_CHECK methods=$METHODS" \
   "repeats=$REPEATS variants=${VARIANTS[*]:-} extra=${EXTRA[*]:-}"; date -u) > "$OUT/env.txt" 2>&1

if (( FUSED_CHECK )); then
  timeout -k 5 "$(left 90)" python3 benchmarks/fused_loss_check.py --sizes "$SIZE" --time-budget 60 \
    --out "$OUT/fused_loss_check.json" 2>&1 | tail -4
  echo "fused_loss_check rc=${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
fi

if (( PEER )); then
  # the comparison first (eager litgpt, our eager and captured steps), then litgpt as its pretrain runs it (compiled)
  # one variant per process: litgpt's eager step beside our captured plain-loss step ran out of memory at 100M (H100)
  timeout -k 5 "$(left 110)" python3 benchmarks/peer_step.py --sizes 100M 350M 1B --one-per-process \
    --variants litgpt ours ours_graph ours_graph_fused \
    --rounds 5 --steps 3 ${COMMIT:+--commit $COMMIT} --out "$OUT/peer_step.json" > "$OUT/peer_step.log" 2>&1
  echo "peer_step rc=$? at $(( $(date +%s) - T0 )) s"
  timeout -k 5 "$(left 200)" python3 benchmarks/peer_step.py --sizes 100M 350M 1B --variants litgpt_compile ours \
    --rounds 3 --steps 3 ${COMMIT:+--commit $COMMIT} --out "$OUT/peer_compile.json" >> "$OUT/peer_step.log" 2>&1
  echo "peer_step (compile) rc=$? at $(( $(date +%s) - T0 )) s"
fi

GIT_ARGS=(--allow-dirty)  # without a stated commit the copy's git state is recorded as found
[[ -n "$COMMIT" ]] && GIT_ARGS=(--commit "$COMMIT")
FIT_LEFT=$(left "$BUDGET")
# shellcheck disable=SC2086  # METHODS: a word list
timeout -k 5 "$FIT_LEFT" python3 benchmarks/fit_throughput.py --sizes "$SIZE" --methods $METHODS --repeats "$REPEATS" \
  "${GIT_ARGS[@]}" --time-budget "$(( FIT_LEFT - 10 ))" --workdir "$WORK/fits" --out "$OUT/fit_$SIZE.json" \
  ${VARIANTS[@]:+--variants "${VARIANTS[@]}"} ${EXTRA[@]:+--extra "${EXTRA[*]}"} > "$OUT/fit_$SIZE.log" 2>&1
echo "fit_throughput rc=$? at $(( $(date +%s) - T0 )) s"

tar czf "$OUT/fits.tgz" -C "$WORK" --exclude data_cache --exclude runs fits 2>/dev/null
(( PEER )) && tail -12 "$OUT/peer_step.log"
tail -8 "$OUT/fit_$SIZE.log"
