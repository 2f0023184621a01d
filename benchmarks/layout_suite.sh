#!/usr/bin/env bash
# One device call for the session-17 kernel options (issue 4; not yet timed), against the defaults in the same
# runs: the block pass's pass_w_tile / pass_dl_buffer (shared memory out of its site loop); the full-mode row
# column kernel's row_w_tile / row_dl_buffer (the same), the fma prefix's prefix_row_3d and the merge's
# merge_tokens (16 spills at 350M; routing.py times its defaults, then the --tune grid). Then train steps with
# the best block config, then Nsight Compute readings of the defaults (stall reasons, occupancy;
# benchmarks/ncu_suite.sh) as far as time allows.
# Usage, from the repository root: benchmarks/layout_suite.sh OUTDIR [SECONDS] [block|full]
#   block (the default): block routing configs, train steps of baseline / block / the best block config, ncu;
#   full: the full-mode grid, train steps of baseline / full MHAR with its defaults and the best full config.
# Each part fits one device call of ~560 s.
set -uo pipefail
OUT_DIR=${1:?output folder}; BUDGET=${2:-560}; PART=${3:-block}
source "$(dirname "$0")/suite_steps.sh"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# best CONFIG_KEY DIR: the config with the least summed graph time over the three shapes (block_routing.py's
# results[CONFIG_KEY], or routing.py's variant names), as train_step.py's "key=value,..." options ("": defaults)
best() {
  python3 - "$1" "$2" <<'PY'
import glob, json, sys
key, folder = sys.argv[1], sys.argv[2]
rows = []
for f in glob.glob(folder + "/*.json"):
    data = json.load(open(f))
    if "results" in data:  # block_routing.py
        rows += [(r["shape"], r.get(key), r["graph_ms"]) for r in data["results"] if "graph_ms" in r]
    else:  # routing.py: shapes -> variants named "triton" or "triton key=value,..."
        for shape, entry in data.get("shapes", {}).items():
            for name, v in entry.get("variants", {}).items():
                variant, _, text = name.partition(" ")
                if variant == "triton" and v.get("graph_ms") is not None:
                    cfg = dict(kv.split("=") for kv in text.split(",")) if text else {}
                    rows.append((shape, cfg, v["graph_ms"]))
by = {}
for shape, cfg, ms in rows:
    by.setdefault(json.dumps(cfg or {}, sort_keys=True), {})[shape] = ms
full = [(sum(v.values()), k) for k, v in by.items() if len(v) == 3]
cfg = json.loads(min(full)[1]) if full else {}
print(",".join(f"{k}={v}" for k, v in cfg.items()))
PY
}
if [[ $PART == block ]]; then
  # (the last config: per-site kernels at 2 warps x 2048 elements, twice the programs per SM with the pass as it
  # is; session 15 timed 2 x 2048 only for every kernel at once, session 16 only 8 warps x 2048)
  step block_routing 40 python3 benchmarks/block_routing.py --graph --profile --variants triton \
    --configs default pass_w_tile=1 pass_w_tile=1,pass_dl_buffer=1 pass_w_tile=1,pass_tile_elements=2048 \
    num_warps=2,tile_elements=2048,pass_tile_elements=4096 --out "$OUT_DIR/block"
  BEST=$(best config "$OUT_DIR/block")
  echo "best block config: ${BEST:-defaults}"
  step train 80 python3 benchmarks/train_step.py --methods baseline block ${BEST:+block:$BEST} --cuda-graph \
    --rounds 12 --steps 3 --out "$OUT_DIR/train_step.json"
  export NCU=${NCU:-$(which ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
  step ncu 99 benchmarks/ncu_suite.sh "$OUT_DIR/ncu" $(( BUDGET * 18 / 100 ))
else
  step routing 60 python3 benchmarks/routing.py --graph --variants triton --tune \
    --grid "row_w_tile=1;row_w_tile=1,row_dl_buffer=1;prefix_row_3d=1;merge_tokens=16;row_w_tile=1,prefix_row_3d=1,merge_tokens=16" \
    --out "$OUT_DIR/full"
  BEST=$(best variant "$OUT_DIR/full")
  echo "best full config: ${BEST:-defaults}"
  step train 98 python3 benchmarks/train_step.py --methods baseline mhar ${BEST:+mhar:$BEST} --cuda-graph \
    --rounds 12 --steps 3 --out "$OUT_DIR/train_step.json"
fi
for f in block_routing routing train ncu; do
  [[ -f "$OUT_DIR/$f.log" ]] && { echo "== $f"; tail -14 "$OUT_DIR/$f.log" | cut -c1-160; }
done
echo "SUITE $(( $(date +%s) - T0 ))s"
