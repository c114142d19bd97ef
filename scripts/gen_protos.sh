#!/usr/bin/env bash
# Regenerate the Python modules for every .proto under src/kiln.
# -I src makes the generated imports absolute (kiln.config.model_config_pb2).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

find src/kiln -name '*.proto' -print0 | sort -z | while IFS= read -r -d '' proto; do
    # No --grpc_python_out: the services are registered from the descriptors under their
    # public wire names (frontends/grpc/services.py), so *_pb2_grpc.py stubs would go unused.
    args=(-I src --python_out=src --pyi_out=src)
    echo "protoc ${proto}"
    "$PYTHON" -m grpc_tools.protoc "${args[@]}" "$proto"
done
