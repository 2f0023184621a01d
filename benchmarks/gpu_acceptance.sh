#!/usr/bin/env bash
# The GPU acceptance run (benchmarks/gpu_acceptance.py says what it runs): one command, under 10 minutes on one
# H100 or H200, from the repository root. The GPU machine lacks litdata, jsonargparse and mlflow-skinny, and the
# liger-kernel of the paper recipes' fused loss: put their wheels in .whl and .whl_fused first
# (../shared/tools/gpu-wheels.sh .whl; benchmarks/gpu_wheels_fused.sh .whl_fused) and carry both. COMMIT is
# recorded in the JSON (the device's copy of the tree has no git history); with $OUT set, the JSON and the logs
# are copied there too.
#     bash benchmarks/gpu_acceptance.sh [COMMIT]
# The JSON is rewritten after every case (to $OUT too), so a call killed at its limit still returns what was
# answered; the device call's limit is the device time left, which can be under timeout_s: keep BUDGET_S
# (default 540) at least 40 s under it, and do not pipe the output through `tail` (a killed pipe prints nothing).
# A run that stops at its budget keeps its report in /tmp/gpu_acceptance: the same command again on the warm
# machine carries over what passed at this commit and runs only the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(.whl/*.whl .whl_fused/*.whl)
if ls "${WHEELS[@]}" > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS[@]}" \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true
python3 -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, sys.argv[1:])))" \
  liger_kernel litdata jsonargparse mlflow || { echo "liger-kernel, litdata," \
  "jsonargparse or mlflow is not importable: carry .whl and .whl_fused (see the top of this file)" >&2; exit 1; }
COMMIT=${1:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
python3 benchmarks/gpu_acceptance.py --commit "$COMMIT" --budget-s "${BUDGET_S:-540}"
rc=$?
if [[ -n "${OUT:-}" ]]; then
  cp benchmarks/results/gpu_acceptance.json "$OUT/" 2>/dev/null
  # the logs and the captured-vs-eager JSON only (checkpoints, stores and caches would pass the size limit)
  (cd /tmp/gpu_acceptance 2>/dev/null && tar czf "$OUT/acceptance_logs.tgz" -- *.log *.json 2>/dev/null)
fi
exit $rc
