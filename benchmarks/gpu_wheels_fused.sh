#!/usr/bin/env bash
# The wheel that model.fused_loss needs on the offline GPU machine (CPython 3.12, x86_64): liger-kernel, whose
# hard requirements (torch, triton) are in that machine's image. benchmarks/gpu_fit_suite.sh installs DEST's
# wheels when DEST is carried (as .whl_fused) next to the base ones (../shared/tools/gpu-wheels.sh: .whl).
#
# Usage, from the repository root:   bash benchmarks/gpu_wheels_fused.sh [DEST]   (DEST defaults to .whl_fused)
#   Idempotent; fails on a hard requirement the GPU machine lacks. Prints the total size.
set -euo pipefail

PIN=liger-kernel==0.8.5   # the version of pyproject's `fused` extra: the kernel is called with its arguments
PRESENT=" torch triton "  # in the GPU machine's image (KINDS.md package list)
DEST="${1:-.whl_fused}"
mkdir -p "$DEST"

if ! ls "$DEST"/liger_kernel-0.8.5-*.whl > /dev/null 2>&1; then
  "${PYTHON:-python3}" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform any -d "$DEST" "$PIN" \
    2> >(grep -v "^WARNING: Location" >&2)
fi
for wheel in "$DEST"/*.whl; do
  while read -r req; do
    dep=$(echo "$req" | sed -E 's/^Requires-Dist: *([A-Za-z0-9_.-]+).*/\1/' | tr 'A-Z_.' 'a-z--')
    [[ "$PRESENT" == *" $dep "* ]] || { echo "${wheel##*/}: $req is not on the GPU machine: add its wheel" >&2; exit 1; }
  done < <(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==')
done
du -ch "$DEST"/*.whl | tail -1 | sed 's/total$/total in '"${DEST//\//\\/}"'/'
