#!/usr/bin/env bash
# One device call for the session-17 kernel options that take shared memory out of the site loops (issue 4; not
# yet timed): the block pass's pass_w_tile / pass_dl_buffer, the full-mode row column kernel's row_w_tile /
# row_dl_buffer and the fma prefix's prefix_row_3d, against the defaults in the same runs (routing.py times its
# defaults, then the --tune grid), then train steps with the best block config, then Nsight
# Compute readings of the defaults (stall reasons, occupancy; benchmarks/ncu_suite.sh) as far as time allows.
# Usage, from the repository root: benchmarks/layout_suite.sh OUTDIR [SECONDS]
set -uo pipefail
OUT_DIR=${1:?output folder}; BUDGET=${2:-560}
source "$(dirname "$0")/suite_steps.sh"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# (the last config: per-site kernels at 2 warps x 2048 elements, twice the programs per SM with the pass as it is;
# session 15 timed 2 x 2048 only for every kernel at once, session 16 only 8 warps x 2048)
step block_routing 34 python3 benchmarks/block_routing.py --graph --profile --variants triton \
  --configs default pass_w_tile=1 pass_w_tile=1,pass_dl_buffer=1 pass_w_tile=1,pass_tile_elements=2048 \
  num_warps=2,tile_elements=2048,pass_tile_elements=4096 --out "$OUT_DIR/block"
step routing 50 python3 benchmarks/routing.py --graph --variants triton --tune \
  --grid "row_w_tile=1;row_w_tile=1,row_dl_buffer=1;prefix_row_3d=1;row_w_tile=1,prefix_row_3d=1" --out "$OUT_DIR/full"
BEST=$(python3 - "$OUT_DIR/block" <<'PY'
import glob, json, sys
rows = [r for f in glob.glob(sys.argv[1] + "/*.json") for r in json.load(open(f))["results"] if "graph_ms" in r]
by = {}
for r in rows:
    by.setdefault(json.dumps(r["config"]), []).append(r["graph_ms"])
best = min((sum(v), k) for k, v in by.items() if len(v) == 3)[1]
cfg = json.loads(best)
print("block:" + ",".join(f"{k}={v}" for k, v in cfg.items()) if cfg else "")
PY
)
echo "best block config: ${BEST:-defaults}"
step train 82 python3 benchmarks/train_step.py --methods baseline block $BEST --cuda-graph --rounds 12 --steps 3 \
  --out "$OUT_DIR/train_step.json"
export NCU=${NCU:-$(which ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
step ncu 99 benchmarks/ncu_suite.sh "$OUT_DIR/ncu" $(( BUDGET * 15 / 100 ))
for f in block_routing routing train ncu; do
  [[ -f "$OUT_DIR/$f.log" ]] && { echo "== $f"; tail -14 "$OUT_DIR/$f.log" | cut -c1-160; }
done
echo "SUITE $(( $(date +%s) - T0 ))s"
