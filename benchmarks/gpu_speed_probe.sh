#!/usr/bin/env bash
# One device call (at most 10 minutes) that answers the open speed questions on one GPU, each part under its own
# share of the budget so that a cut keeps what came first:
#   1. tests/test_fused_ops_gpu.py: model.fused_ops (liger's RMSNorm, RoPE, SiLU * up) is the plain function on CUDA;
#      with the CUDA tests of tests/test_decode_paths.py (compiled kernels, not the tests' default interpreter)
#   2. decode at 350M, batch 1 and 16, prompt 128, 128 new tokens: the CUDA-graph step plain, with --fused-ops and
#      with --compile-step (transformers' eager and compiled generate beside it in the plain run only); and the
#      first token at batch 16 of prompts of 1,024 tokens (the prefill, full MHAR's routed by the Triton kernels)
#   3. peer_step at 100M and 1B, one variant per process: our captured step with the fused loss, plus fused_ops,
#      plus torch.compile inside the capture, and litgpt compiled as its pretrain runs it
#   4. fit_throughput at 100M through `fit` (the recipe, fused loss): bf16-true, bf16-mixed, and fused_ops
# From the repository root, with .whl, .whl_fused and .whl_peer carried (../shared/tools/gpu-wheels.sh .whl,
# benchmarks/gpu_wheels_fused.sh .whl_fused, benchmarks/gpu_wheels_peer.sh .whl_peer):
#     bash benchmarks/gpu_speed_probe.sh COMMIT [BUDGET_S]      (BUDGET_S default 540)
# $OUT receives env.txt, fused_ops_gpu.log, decode_plain.json, decode_long_prompt.json, decode_fusedops.json,
# decode_compiled.json, peer.json, fit_100M.json and probe.log (every part's output); 8 files, what a device call
# returns. The last lines are a summary table.
set -uo pipefail
cd "$(dirname "$0")/.."
COMMIT=${1:?usage: bash benchmarks/gpu_speed_probe.sh COMMIT [BUDGET_S]}
BUDGET=${2:-540}
OUT=${OUT:?OUT must name the folder for the results}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl_fused/*.whl .whl_peer/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true
T0=$(date +%s)
until_s() { echo $(( T0 + $1 - $(date +%s) )); }  # seconds left until second $1 of the budget
LOG="$OUT/probe.log"
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
 python3 -c "import torch, triton, liger_kernel; print(torch.__version__, triton.__version__)"
 echo "commit (stated): $COMMIT"; date -u) > "$OUT/env.txt" 2>&1

# compiled kernels (tests/conftest.py sets the interpreter unless told otherwise): fused_ops, and the prefill of full
# mode on the routing kernels against the CPU's tokens
TRITON_INTERPRET=0 timeout -k 5 "$(until_s 60)" python3 -m pytest -q -p no:cacheprovider -s \
  tests/test_fused_ops_gpu.py tests/test_decode_paths.py -k "cuda or fused" > "$OUT/fused_ops_gpu.log" 2>&1
echo "fused_ops_gpu rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"

DECODE=(--models 350M-standard 350M-mhar-h8 --batches 1 16 --prompts 128 --new-tokens 128 --reps 3 --commit "$COMMIT")
LONG=(--batches 16 --prompts 1024 --new-tokens 16 --peers eager)  # the first token of long prompts (prefill)
for spec in "plain:165:--peers eager compiled" "long_prompt:205:${LONG[*]}" "fusedops:245:--peers --fused-ops" \
            "compiled:290:--peers --compile-step"; do
  IFS=: read -r name until flags <<< "$spec"
  left=$(until_s "$until")
  # shellcheck disable=SC2086  # flags: a word list; a later --batches/--prompts/--new-tokens replaces DECODE's
  timeout -k 5 "$left" python3 benchmarks/decode.py "${DECODE[@]}" $flags --budget-s "$(( left - 10 ))" \
    --out "$OUT/decode_$name.json" >> "$LOG" 2>&1
  echo "decode $name rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"
done

timeout -k 5 "$(until_s 430)" python3 benchmarks/peer_step.py --sizes 100M 1B --one-per-process --rounds 3 --steps 3 \
  --variants ours_graph_fused ours_graph_fusedops_fused ours_graph_compile_fused litgpt_compile \
  --commit "$COMMIT" --out "$OUT/peer.json" >> "$LOG" 2>&1
echo "peer_step rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"

left=$(until_s "$BUDGET")
timeout -k 5 "$left" python3 benchmarks/fit_throughput.py --sizes 100M --methods baseline mhar --repeats 1 \
  --commit "$COMMIT" --time-budget "$(( left - 10 ))" --workdir /tmp/probe_fits --out "$OUT/fit_100M.json" \
  --variants "bf16-true=" "mixed=--trainer.precision=bf16-mixed" "fused_ops=--model.fused_ops=true" >> "$LOG" 2>&1
echo "fit_throughput rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"

grep -E "passed|failed" "$OUT/fused_ops_gpu.log" | tail -2
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("decode_*.json")):
    report = json.loads(path.read_text())
    for c in report["cases"]:
        print(f"{path.stem:<18} {c['model']:<14} batch {c['batch']:>2}: {c['tokens_per_s']:8.0f} tokens/s, "
              f"TTFT {c['ttft_ms']:6.1f} ms (transformers eager {c.get('transformers_eager_tokens_per_s')}, "
              f"compiled {c.get('transformers_compiled_tokens_per_s')})")
peer = out / "peer.json"
if peer.exists():
    for size in json.loads(peer.read_text())["sizes"]:
        for name, row in size["variants"].items():
            print(f"peer {size['size']:<5} {name:<26} {row['tokens_per_s']:10.0f} tokens/s  MFU {row['mfu']:.3f}")
EOF
tail -6 "$LOG"
