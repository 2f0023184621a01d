#!/usr/bin/env bash
# One device call (at most 10 minutes) that answers the open speed questions on one GPU. PARTS (default: all four,
# more than one call's 540 s: name two per call) picks the parts; each runs under its own time limit and within
# the call's budget, so that a cut keeps what came first:
#   tests   tests/test_fused_ops_gpu.py and the CUDA tests of tests/test_decode_paths.py with compiled kernels
#           (tests/conftest.py otherwise selects Triton's interpreter)                                  (<= 60 s)
#   decode  350M standard and full MHAR H 8 and the converted Qwen3-0.6B shape (delta, H 8), batch 1 and 16,
#           prompt 128, 128 new tokens: generate's default (on CUDA a captured step with liger's fused ops and
#           the decode routing kernels) beside transformers' eager generate; the 350M pair again with
#           --plain-ops; then the first token at batch 16 of prompts of 1,024 tokens                     (<= 260 s)
#   peer    peer_step at 100M and 1B, one variant per process: our captured step with the fused loss and fused
#           ops (the recipes' settings), and litgpt compiled as its pretrain runs it                      (<= 300 s)
#   fit     fit_throughput at 100M through `fit` with the recipe (fused loss and ops), baseline and MHAR, against
#           --model.fused_ops=false                                                                       (<= 300 s)
# From the repository root, with .whl, .whl_fused and .whl_peer carried (../shared/tools/gpu-wheels.sh .whl,
# benchmarks/gpu_wheels_fused.sh .whl_fused, benchmarks/gpu_wheels_peer.sh .whl_peer):
#     PARTS="tests decode" bash benchmarks/gpu_speed_probe.sh COMMIT [BUDGET_S]      (BUDGET_S default 540)
# $OUT receives probe.log (every part's output, a summary table last) and probe.tgz (the parts' JSON and logs):
# two files, well under the 8 a device call returns.
set -uo pipefail
cd "$(dirname "$0")/.."
COMMIT=${1:?usage: PARTS="..." bash benchmarks/gpu_speed_probe.sh COMMIT [BUDGET_S]}
BUDGET=${2:-540}
PARTS=${PARTS:-tests decode peer fit}
OUT=${OUT:?OUT must name the folder for the results}
RES=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl_fused/*.whl .whl_peer/*.whl > /dev/null 2>&1 || { echo "wheel install failed" >&2; exit 1; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true
T0=$(date +%s)
LOG="$OUT/probe.log"
limit() { local left=$(( T0 + BUDGET - $(date +%s) )); echo $(( left < $1 ? left : $1 )); }  # min(part's, left)
wants() { [[ " $PARTS " == *" $1 "* ]]; }
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
 python3 -c "import torch, triton, liger_kernel; print(torch.__version__, triton.__version__)"
 echo "commit (stated): $COMMIT; parts: $PARTS"; date -u) > "$RES/env.txt" 2>&1

if wants tests; then
  TRITON_INTERPRET=0 timeout -k 5 "$(limit 60)" python3 -m pytest -q -p no:cacheprovider -s -rf \
    tests/test_fused_ops_gpu.py tests/test_decode_paths.py -k "cuda or fused" > "$RES/gpu_tests.log" 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"
fi

if wants decode; then
  DECODE=(--models 350M-standard 350M-mhar-h8 --batches 1 16 --prompts 128 --new-tokens 128 --reps 3 --commit "$COMMIT")
  part_end=$(( $(date +%s) + 260 ))
  for spec in "default:--models 350M-standard 350M-mhar-h8 qwen3-0.6b-delta-h8 --peers eager" \
              "plain_ops:--peers --plain-ops" \
              "long_prompt:--batches 16 --prompts 1024 --new-tokens 16 --peers eager"; do
    IFS=: read -r name flags <<< "$spec"
    left=$(limit $(( part_end - $(date +%s) )))
    # shellcheck disable=SC2086  # flags: a word list; a later --batches/--prompts/--new-tokens replaces DECODE's
    timeout -k 5 "$left" python3 benchmarks/decode.py "${DECODE[@]}" $flags --budget-s "$(( left - 10 ))" \
      --out "$RES/decode_$name.json" >> "$LOG" 2>&1
    echo "decode $name rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"
  done
fi

if wants peer; then
  timeout -k 5 "$(limit 300)" python3 benchmarks/peer_step.py --sizes 100M 1B --one-per-process --rounds 3 --steps 3 \
    --variants ours_graph_fusedops_fused litgpt_compile --commit "$COMMIT" --out "$RES/peer.json" >> "$LOG" 2>&1
  echo "peer_step rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"
fi

if wants fit; then
  left=$(limit 300)
  timeout -k 5 "$left" python3 benchmarks/fit_throughput.py --sizes 100M --methods baseline mhar --repeats 1 \
    --commit "$COMMIT" --time-budget "$(( left - 10 ))" --workdir /tmp/probe_fits --out "$RES/fit_100M.json" \
    --variants "recipe=" "plain_ops=--model.fused_ops=false" >> "$LOG" 2>&1
  echo "fit_throughput rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"
fi

(cd "$RES" && tar czf "$OUT/probe.tgz" -- *)
grep -E "passed|failed" "$RES/gpu_tests.log" 2>/dev/null | tail -2
python3 - "$RES" <<'EOF' | tee -a "$LOG"
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
for path in sorted(res.glob("decode_*.json")):
    for c in json.loads(path.read_text())["cases"]:
        print(f"{path.stem:<18} {c['model']:<14} batch {c['batch']:>2} prompt {c['prompt']:>4}: "
              f"{c['tokens_per_s']:8.0f} tokens/s, TTFT {c['ttft_ms']:6.1f} ms "
              f"(transformers eager {c.get('transformers_eager_tokens_per_s')}, TTFT {c.get('transformers_eager_ttft_ms')})")
for path in sorted(res.glob("peer*.json")):
    for size in json.loads(path.read_text()).get("sizes", []):
        for name, row in size["variants"].items():
            print(f"peer {size['size']:<5} {name:<26} {row['tokens_per_s']:10.0f} tokens/s  MFU {row['mfu']:.3f}")
EOF
