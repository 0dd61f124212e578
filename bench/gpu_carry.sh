#!/usr/bin/env bash
# Wheels that bench/gpu.py needs on a bare GPU host (PyTorch with CUDA, onnx, onnxruntime,
# numpy, msgpack, matplotlib installed; no registry there), fetched here into .gpu-wheels/
# (git-ignored through .git/info/exclude; about 10 MB, under a call's 64 MiB):
#
#   bash bench/gpu_carry.sh            # here, once
#   # there, carrying .gpu-wheels with the tree, one command:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl \
#     && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 -m bench.gpu
#
# PY_VERSION sets the host's Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PY_VERSION:-3.12}"
dest=.gpu-wheels
grep -qx "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude
mkdir -p "$dest"
pip=(python3 -m pip download --no-deps --only-binary=:all: --python-version "$py" --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest")
# onnx2torch: the converter (pure Python); the rest: the project's base needs that the host lacks
# (grpcio-health-checking and -reflection 1.82 and newer need protobuf 7: --no-deps takes the
# newest of each, which fit together)
"${pip[@]}" onnx2torch "zstandard>=0.22" "lz4>=4.3" "grpcio>=1.60" "grpcio-health-checking>=1.60" \
    "grpcio-reflection>=1.60" "protobuf>=6.33.5"
du -sh "$dest"
