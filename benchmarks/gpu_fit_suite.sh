#!/usr/bin/env bash
# One device call (at most 10 minutes): a peer trainer's step against our baseline's (benchmarks/peer_step.py:
# litgpt eager and captured-ours at 100M / 350M / 1B, then litgpt under torch.compile) and the shipped recipes of
# ONE size through `python -m mhar_lit fit` (benchmarks/fit_throughput.py: baseline, mhar, block-mhar, 3 repeats
# each, interleaved). From the repository root, with .whl (../shared/tools/gpu-wheels.sh) and .whl_peer
# (benchmarks/gpu_wheels_peer.sh) carried:
#
#   bash benchmarks/gpu_fit_suite.sh SIZE [COMMIT] [--no-peer] [-- FIT OVERRIDES...]
#     SIZE    100M, 350M or 1B
#     COMMIT  the commit of the copied tree (the device's copy has no usable git history); recorded as stated
#     --no-peer   skip peer_step.py: the fits get the whole call (350M and 1B need it: ~9 fits of 40-60 s)
#     FIT OVERRIDES  appended to every fit, e.g. -- --model.cuda_graph true
#
#   bash benchmarks/gpu_fit_suite.sh --print-call SIZE [ARGS...]   (here, not on the device) checks the tree is
#     committed and the wheel folders exist, and prints the `run` call with this checkout's commit.
#
# $OUT receives at most 7 files: env.txt, peer_step.json, peer_compile.json, peer_step.log, fit_SIZE.json,
# fit_SIZE.log and fits.tgz (every fit's log and MLflow store).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--print-call" ]]; then
  shift
  [[ -n "${1:-}" ]] || { echo "usage: $0 --print-call SIZE [--no-peer] [-- FIT OVERRIDES]" >&2; exit 2; }
  if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
    echo "the tree has uncommitted changes: commit them first (the call measures the committed code)" >&2; exit 1
  fi
  for d in .whl .whl_peer; do
    ls "$d"/*.whl > /dev/null 2>&1 || { echo "$d/ has no wheels: run ../shared/tools/gpu-wheels.sh .whl and" \
      "benchmarks/gpu_wheels_peer.sh .whl_peer here first" >&2; exit 1; }
  done
  size=$1; shift
  echo "run(command=\"bash benchmarks/gpu_fit_suite.sh $size $(git rev-parse HEAD)${*:+ $*}\", carry=[\".whl\", \".whl_peer\"], timeout_s=600)"
  echo "travels: $(du -sch .whl .whl_peer | tail -1 | cut -f1) of wheels plus the tree"
  exit 0
fi

SIZE=${1:?usage: bash benchmarks/gpu_fit_suite.sh SIZE [COMMIT] [--no-peer] [-- FIT OVERRIDES]}; shift
COMMIT=""; PEER=1; EXTRA=()
while (( $# )); do
  case "$1" in
    --no-peer) PEER=0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) [[ "$1" =~ ^[0-9a-f]{7,40}$ ]] || { echo "unknown argument $1" >&2; exit 2; }; COMMIT=$1 ;;
  esac
  shift
done
case "$SIZE" in 100M|350M|1B) ;; *) echo "SIZE must be 100M, 350M or 1B, got $SIZE" >&2; exit 2 ;; esac
OUT=${OUT:?OUT must name the folder for the results}
WORK=/tmp/fit_suite
mkdir -p "$WORK" "$OUT"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl_peer/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true
T0=$(date +%s)
BUDGET=560  # seconds from here; install and the tar at the end take the rest of the 600
left() { echo $(( T0 + $1 - $(date +%s) )); }  # seconds until second $1 of the budget

(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
 python3 -c "import sys, torch, triton, lightning; print(sys.version.split()[0], torch.__version__, triton.__version__, lightning.__version__)"
 echo "commit (stated): ${COMMIT:-none}"; echo "suite: $SIZE peer=$PEER extra=${EXTRA[*]:-}"; date -u) > "$OUT/env.txt" 2>&1

if (( PEER )); then
  # the comparison first (eager litgpt, our eager and captured steps), then litgpt as its pretrain runs it (compiled)
  timeout -k 5 "$(left 110)" python3 benchmarks/peer_step.py --sizes 100M 350M 1B --variants litgpt ours ours_graph \
    --rounds 5 --steps 3 ${COMMIT:+--commit $COMMIT} --out "$OUT/peer_step.json" > "$OUT/peer_step.log" 2>&1
  echo "peer_step rc=$? at $(( $(date +%s) - T0 )) s"
  timeout -k 5 "$(left 200)" python3 benchmarks/peer_step.py --sizes 100M 350M 1B --variants litgpt_compile ours \
    --rounds 3 --steps 3 ${COMMIT:+--commit $COMMIT} --out "$OUT/peer_compile.json" >> "$OUT/peer_step.log" 2>&1
  echo "peer_step (compile) rc=$? at $(( $(date +%s) - T0 )) s"
fi

GIT_ARGS=(--allow-dirty)  # without a stated commit the copy's git state is recorded as found
[[ -n "$COMMIT" ]] && GIT_ARGS=(--commit "$COMMIT")
FIT_LEFT=$(left "$BUDGET")
timeout -k 5 "$FIT_LEFT" python3 benchmarks/fit_throughput.py --sizes "$SIZE" --repeats 3 "${GIT_ARGS[@]}" \
  --time-budget "$(( FIT_LEFT - 10 ))" --workdir "$WORK/fits" --out "$OUT/fit_$SIZE.json" \
  ${EXTRA[@]:+--extra "${EXTRA[*]}"} > "$OUT/fit_$SIZE.log" 2>&1
echo "fit_throughput rc=$? at $(( $(date +%s) - T0 )) s"

tar czf "$OUT/fits.tgz" -C "$WORK" --exclude data_cache --exclude runs fits 2>/dev/null
(( PEER )) && tail -12 "$OUT/peer_step.log"
tail -8 "$OUT/fit_$SIZE.log"
