#!/usr/bin/env bash
# The block-mode benchmarks of one device call (issue 4), each step with its own deadline: block routing fwd+bwd
# of this tree (defaults and three configs, CUDA graph, per-kernel profile), the same script in an A/B copy of
# another commit if given, the PyTorch backend direct vs two-phase, training steps against the baseline (CUDA graphs) and the memory peaks.
# Usage, from the repository root: benchmarks/block_suite.sh OUTDIR [SECONDS] [AB_DIR]
#   AB_DIR: a copy of another commit's files (e.g. `git archive b8cd2bb mhar_lit benchmarks/routing.py
#   benchmarks/block_routing.py pyproject.toml | tar -x -C .ab/head`, carried to the device as .ab)
set -uo pipefail
OUT_DIR=${1:?output folder}; BUDGET=${2:-500}; AB_DIR=${3:-}
source "$(dirname "$0")/suite_steps.sh"  # T0, step, the output folder and env.txt
OUT_DIR=$(cd "$OUT_DIR" && pwd)
step block_routing 30 python3 benchmarks/block_routing.py --graph --profile --variants triton \
  --configs default 8x2048x1 4x2048x1 8x2048x2 --out "$OUT_DIR/new"
if [[ -n "$AB_DIR" ]]; then
  step block_routing_ab 42 bash -c "cd '$AB_DIR' && python3 benchmarks/block_routing.py --graph --variants triton --out '$OUT_DIR/ab'"
fi
# the PyTorch backend, direct against SPEC D's two-phase computation (fwd+bwd, then forward only)
step block_torch 50 bash -c "python3 benchmarks/block_routing.py --variants torch torch_two_phase --out '$OUT_DIR/torch' &&
  python3 benchmarks/block_routing.py --variants torch torch_two_phase --forward-only --out '$OUT_DIR/torch'"
step train 87 python3 benchmarks/train_step.py --methods baseline block --cuda-graph --rounds 8 --steps 3 \
  --out "$OUT_DIR/train_step.json"
step memory 100 python3 benchmarks/memory_peak.py --sizes 100M 350M 1B --methods baseline block
for f in block_routing block_routing_ab block_torch train memory; do
  [[ -f "$OUT_DIR/$f.log" ]] && { echo "== $f"; tail -12 "$OUT_DIR/$f.log"; }
done
echo "SUITE $(( $(date +%s) - T0 ))s"
