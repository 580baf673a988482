#!/bin/bash
# The wheels the GPU check's machine lacks (bench/gpu/wheels.txt), downloaded here for CPython 3.12 on
# x86-64 manylinux into DIR (default .whl, which .gitignore keeps out of git), ready to be carried there:
#   bench/gpu/fetch_wheels.sh [DIR]; then on the device: make gpu-check WHEELS=.whl (with .whl carried)
# Run it before a device session, not in one: that machine reaches no registry, and its minutes are few.
set -euo pipefail
DIR=${1:-.whl}
PY=${PY:-python3}
mkdir -p "$DIR"
specs=$(sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/' "$(dirname "$0")/wheels.txt")
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" $specs
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
