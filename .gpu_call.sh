set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
G="prefix_warps=4;prefix_warps=4,prefix_unroll=2;prefix_tokens=8,prefix_warps=4;prefix_tokens=4,prefix_warps=4;prefix_unroll=2"
timeout 200 python3 benchmarks/profile_routing.py --configs "$G" 2>&1 | tee $R/profile.log | grep -E "^\S|prefix" | head -60
echo "profile done at $(( $(date +%s) - T0 )) s"
timeout 300 python3 benchmarks/routing.py --variants triton --graph --tune --grid "prefix_warps=4;prefix_tokens=8,prefix_warps=4" --out $R 2>&1 | tee $R/routing.log | tail -25
echo "all done at $(( $(date +%s) - T0 )) s"
tar czf $OUT/r.tgz -C $OUT r
