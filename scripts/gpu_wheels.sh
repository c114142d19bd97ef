#!/usr/bin/env bash
# Run HERE (a machine with network), from the repository root, before a GPU device call:
# downloads the Python 3.12 wheels kiln needs that the lent GPU machines' image lacks (it has
# torch, triton, transformers, numpy, grpcio, protobuf, click, rich, numba, tokenizers,
# safetensors, pytest...; /work/.library/device/KINDS.md lists it) into .whl/, which git
# ignores and scripts/gpu_check.sh installs there. Pass more names as arguments when
# gpu_check.sh's import check reports a missing module.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
mkdir -p .whl
PY=${PYTHON:-python3}
# kiln serve's HTTP stack, the structured-output grammar engine, the engine process's messages
# (msgspec), tool schemas (jsonschema and its needs), .gguf files, the tests' Triton client
# (tritonclient's HTTP side and its needs), and the extra names given. Not protobuf: the
# image's runtime reads kiln's 5.x gencode and its onnx needs the newer one. manylinux_2_31:
# llguidance's newer wheels.
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -c requirements/constraints.txt -d .whl \
  starlette uvicorn httptools orjson llguidance msgspec jsonschema jsonschema-specifications \
  referencing rpds-py gguf \
  tritonclient geventhttpclient gevent greenlet zope.event zope.interface brotli python-rapidjson \
  "$@"
du -sh .whl
