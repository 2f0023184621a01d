#!/usr/bin/env bash
# GPU verification of the routing: the kernel tests (Triton interpreter, which tests/kernels/conftest.py selects),
# the tests that run on CUDA where one is present (CUDA-graph capture, the routing matrix at real widths, the
# captured decode step), the sm_90 compile
# check of every kernel, then the training-step no-regression check of the baseline, full-mode MHAR and
# block-mode MHAR with CUDA-graph capture.
#     bash benchmarks/gpu_check.sh [--sizes 100M 350M 1B]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pytest -q tests/kernels tests/test_cuda_graph.py tests/test_generation.py
TRITON_INTERPRET=0 python3 -m pytest -q tests/test_gpu_routing_matrix.py  # compiled kernels: a process of its own
python3 benchmarks/train_step.py --methods baseline mhar block --cuda-graph "$@"
