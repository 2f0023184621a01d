#!/usr/bin/env bash
# The kernel benchmarks of one device call (issue 4), in order of cost, each with its own deadline so that a
# slow step cannot eat the rest: launch overhead, routing fwd+bwd (fast launch on, then off), the per-kernel
# profile, the memory peak breakdown, full training steps. Usage: benchmarks/kernel_suite.sh OUTDIR SECONDS
# (run from the repository root; logs and JSON land in OUTDIR; SECONDS is the wall budget of the whole suite).
set -uo pipefail
OUT_DIR=${1:?output folder}; BUDGET=${2:-500}
source "$(dirname "$0")/suite_steps.sh"  # T0, step, the output folder and env.txt
step launch 5 python3 benchmarks/launch_overhead.py
step routing 35 python3 benchmarks/routing.py --variants torch triton_percall triton --tune \
  --grid "prefix_unroll=1;suffix_unroll=2;suffix_unroll=4" --out "$OUT_DIR"
step routing_slow_launch 45 env MHAR_FAST_LAUNCH=0 python3 benchmarks/routing.py --variants triton \
  --out "$OUT_DIR/slow_launch"
step profile 58 python3 benchmarks/profile_routing.py
step memory 70 python3 benchmarks/memory_peak.py --sizes 350M 1B
step train 100 python3 benchmarks/train_step.py --out "$OUT_DIR/train_step.json"
echo "SUITE $(( $(date +%s) - T0 ))s"
