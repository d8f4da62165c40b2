#!/usr/bin/env bash
# Download the wheels .device/wheels.txt names into .whl/ at the repository root (ignored by git), for the GPU
# machine's Python (CPython 3.12, manylinux x86_64), which cannot reach a package index. Run it once here, then
# name `.whl` in the device call's `carry` (docs/gpu.md). Uses $PYTHON's pip (default: python3).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
mkdir -p "$root/.whl"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
grep -v '^\s*#' "$root/.device/wheels.txt" | sed 's/#.*//' | awk 'NF {print $1}' | while read -r pin; do
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$root/.whl" "$pin"
done
ls -l "$root/.whl"
du -sh "$root/.whl"
