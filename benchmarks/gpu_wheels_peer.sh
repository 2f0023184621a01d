#!/usr/bin/env bash
# Wheels of the peer trainer that benchmarks/peer_step.py times (litgpt), for the offline GPU machine
# (CPython 3.12, x86_64), on top of the base wheels of ../shared/tools/gpu-wheels.sh (litdata, jsonargparse,
# mlflow-skinny). Only what the machine lacks: litgpt's hard requirements (huggingface-hub, jsonargparse,
# lightning, psutil, safetensors, tokenizers, torch, tqdm) are in its image or in the base wheels; its extras
# (lightning-thunder is only in `compiler`) are not needed to build and train its GPT.
# The script lists every hard requirement of the downloaded wheels and fails on one that neither covers.
# Versions are not matched: litgpt 0.5.13 pins huggingface-hub<1.4, jsonargparse<=4.41 and psutil==7.2.2, and the
# GPU machine has huggingface-hub 1.33 and jsonargparse 4.53 (base wheels); with --no-deps pip does not check, and
# `import litgpt`, its Qwen3 GPT and training steps were checked with huggingface-hub 2.4 and jsonargparse 4.53.
#
# Usage, from the repository root:   bash benchmarks/gpu_wheels_peer.sh [DEST]     (DEST defaults to .whl_peer)
#   Idempotent: a wheel already in DEST is kept. Prints the total size and the install line.
set -euo pipefail

PINS=(litgpt==0.5.13)
# on the GPU machine's image (KINDS.md package list, 2026-11-17) or in gpu-wheels.sh's wheels
PRESENT="torch triton lightning lightning-utilities huggingface-hub safetensors tokenizers tqdm psutil numpy pyyaml
  typing-extensions filelock fsspec jinja2 regex requests packaging jsonargparse docstring-parser typeshed-client"

PYTHON="${PYTHON:-python3}"
DEST_ARG="${1:-.whl_peer}"
mkdir -p "$DEST_ARG"
DEST="$(cd "$DEST_ARG" && pwd)"

for pin in "${PINS[@]}"; do
  name=${pin%%==*}; version=${pin##*==}
  if ! ls "$DEST"/"${name//-/_}"-"$version"-*.whl > /dev/null 2>&1; then
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$DEST" "$pin" 2> >(grep -v "^WARNING: Location" >&2)
  fi
done

missing=0
for wheel in "$DEST"/*.whl; do
  # hard requirements only: lines without an `extra ==` marker
  while read -r req; do
    dep=$(echo "$req" | sed -E 's/^Requires-Dist: *([A-Za-z0-9_.-]+).*/\1/' | tr 'A-Z_.' 'a-z--')
    if echo " $PRESENT " | tr -s ' \n' ' ' | grep -q " $dep "; then
      echo "  ${wheel##*/}: $req  (present)"
    elif ls "$DEST"/*.whl | sed 's#.*/##' | tr 'A-Z_.' 'a-z--' | grep -q "^$dep-"; then
      echo "  ${wheel##*/}: $req  (in $DEST_ARG)"
    else
      echo "  ${wheel##*/}: $req  MISSING on the GPU machine" >&2; missing=1
    fi
  done < <(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==')
done
(( missing == 0 )) || { echo "error: add the missing requirements to PINS" >&2; exit 1; }

total=0
for f in "$DEST"/*.whl; do
  size=$(stat -c %s "$f"); total=$((total + size))
  awk -v b="$size" -v f="${f##*/}" 'BEGIN{printf "  %8.2f MiB  %s\n", b/1048576, f}'
done
awk -v b="$total" 'BEGIN{printf "total: %.2f MiB\n", b/1048576}'
echo "install line for the GPU machine (with the base wheels):"
echo "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $(printf %q "${DEST_ARG%/}")/*.whl && export PYTHONPATH=/tmp/site"
