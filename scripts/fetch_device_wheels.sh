#!/bin/bash
# Download the wheels a GPU machine's image lacks (scripts/device_wheels.txt) into DIR (default
# .whl/, which git ignores), for the device's Python (3.12, manylinux x86_64), with no dependency
# resolution: the list is complete. Then, on the device: bash scripts/device_check.sh --wheels DIR.
#
#   bash scripts/fetch_device_wheels.sh [DIR] [--python-version 3.12]
set -euo pipefail
dir=.whl
pyver=3.12
while (($#)); do
  case $1 in
    --python-version) pyver=$2; shift 2 ;;
    *) dir=$1; shift ;;
  esac
done
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64)
mapfile -t wheels < <(grep -v '^\s*#' "$here/device_wheels.txt" | grep -v '^\s*$')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${plat[@]}" -d "$dir" "${wheels[@]}"
echo "${#wheels[@]} wheels in $dir ($(du -sh "$dir" | cut -f1))"
