#!/usr/bin/env bash
# Nsight Compute readings of the routing kernels that decide the remaining targets (issue 4): per kernel its time,
# achieved occupancy and what limits it, DRAM / L2 throughput and the warp stall reasons; for the block pass and
# forward at 1B also the per-instruction stall samples (SASS). Each reading is one ncu run of
# benchmarks/ncu_routing.py (its last iteration profiled), filtered to one kernel and a few launches of it.
# Usage, from the repository root: benchmarks/ncu_suite.sh OUTDIR [SECONDS] [knob=value ...]  (block-mode knobs)
set -uo pipefail
OUT_DIR=${1:?output folder}; BUDGET=${2:-400}; shift 2 || true
source "$(dirname "$0")/suite_steps.sh"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
NCU=${NCU:-ncu}
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats"
# reading NAME PCT MODE SHAPE KERNEL SKIP COUNT [extra ncu args]: launches SKIP .. SKIP+COUNT-1 of KERNEL
reading() {
  local name=$1 pct=$2 mode=$3 shape=$4 kernel=$5 skip=$6 count=$7; shift 7
  step "ncu_$name" "$pct" $NCU --clock-control none --profile-from-start off --kernel-name "regex:$kernel" \
    --launch-skip "$skip" --launch-count "$count" $SECTIONS "$@" -f -o "$OUT_DIR/$name" \
    python3 benchmarks/ncu_routing.py --mode "$mode" --shape "$shape" "${KNOBS[@]}"
  [[ -f "$OUT_DIR/$name.ncu-rep" ]] && $NCU --import "$OUT_DIR/$name.ncu-rep" --page raw --csv > "$OUT_DIR/$name.raw.csv" 2>/dev/null
}
KNOBS=("$@")
# block mode: the pass of the last (largest) block and the one before; a late forward site; a site backward
reading block_pass_1B 14 block 1B _block_pass_bwd_kernel 0 2 --section SourceCounters
reading block_fwd_1B 24 block 1B _block_fwd_kernel 66 1 --section SourceCounters
reading block_site_1B 30 block 1B _block_site_bwd_kernel 10 1
reading block_pass_350M 38 block 350M _block_pass_bwd_kernel 0 2
reading block_fwd_350M 44 block 350M _block_fwd_kernel 44 1
reading block_site_350M 50 block 350M _block_site_bwd_kernel 10 1
KNOBS=()
# full mode at 100M (routing 4.7 ms against 4): a mid row column, the suffix, prefix, merge and dq/dg
reading full_column_100M 60 full 100M _column_row_bwd_kernel 12 1
reading full_suffix_100M 68 full 100M _suffix_dot_bwd_kernel 0 1
reading full_prefix_100M 76 full 100M _prefix 0 1
reading full_merge_100M 84 full 100M _merge_fwd_kernel 18 1
reading full_qgrad_100M 90 full 100M _query_grad_kernel 0 1
for rep in "$OUT_DIR"/block_pass_1B.ncu-rep "$OUT_DIR"/block_fwd_1B.ncu-rep; do
  [[ -f "$rep" ]] && $NCU --import "$rep" --page source --csv --print-source sass > "${rep%.ncu-rep}.sass.csv" 2>/dev/null
done
python3 benchmarks/ncu_summary.py "$OUT_DIR"/*.raw.csv | tee "$OUT_DIR/summary.txt"
echo "SUITE $(( $(date +%s) - T0 ))s"
