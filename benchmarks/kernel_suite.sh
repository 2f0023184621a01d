#!/usr/bin/env bash
# The kernel benchmarks of one device call (issue 4), in order of cost, each with its own deadline so that a
# slow step cannot eat the rest: launch overhead, routing fwd+bwd (fast launch on, then off), the per-kernel
# profile, the memory peak breakdown, full training steps. Usage: benchmarks/kernel_suite.sh OUTDIR SECONDS
# (run from the repository root; logs and JSON land in OUTDIR; SECONDS is the wall budget of the whole suite).
set -uo pipefail
OUT_DIR=${1:?output folder}; BUDGET=${2:-500}
T0=$(date +%s)
left() { echo $(( T0 + BUDGET * $1 / 100 - $(date +%s) )); }  # seconds left until $1 % of the budget
step() {  # step NAME PERCENT COMMAND...: run COMMAND until PERCENT of the budget, log to OUTDIR/NAME.log
  local name=$1 pct=$2; shift 2
  local t=$(left "$pct")
  if (( t < 5 )); then echo "SKIP $name (no time left)"; return; fi
  local s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$OUT_DIR/$name.log" 2>&1
  echo "STEP $name rc=$? $(( $(date +%s) - s ))s"
}
mkdir -p "$OUT_DIR"
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
 python3 -c "import sys,torch,triton;print(sys.version.split()[0],torch.__version__,triton.__version__)"
 git rev-parse HEAD 2>/dev/null; date -u) > "$OUT_DIR/env.txt" 2>&1
step launch 5 python3 benchmarks/launch_overhead.py
step routing 35 python3 benchmarks/routing.py --variants torch triton_percall triton --tune \
  --grid "prefix_unroll=1;suffix_unroll=2;suffix_unroll=4" --out "$OUT_DIR"
step routing_slow_launch 45 env MHAR_FAST_LAUNCH=0 python3 benchmarks/routing.py --variants triton \
  --out "$OUT_DIR/slow_launch"
step profile 58 python3 benchmarks/profile_routing.py
step memory 70 python3 benchmarks/memory_peak.py --sizes 350M 1B
step train 100 python3 benchmarks/train_step.py --out "$OUT_DIR/train_step.json"
echo "SUITE $(( $(date +%s) - T0 ))s"
