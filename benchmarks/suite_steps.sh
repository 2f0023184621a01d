# Sourced by the device-call suites (kernel_suite.sh, block_suite.sh) after they set OUT_DIR and BUDGET: deadlines
# per step and the environment record. step NAME PERCENT COMMAND...: run COMMAND until PERCENT of the budget has
# passed, log to OUTDIR/NAME.log.
T0=$(date +%s)
left() { echo $(( T0 + BUDGET * $1 / 100 - $(date +%s) )); }  # seconds left until $1 % of the budget
step() {
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
