#!/usr/bin/env bash
# Regenerate the Python modules for every .proto under src/kiln.
# -I src makes the generated imports absolute (kiln.config.model_config_pb2).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

find src/kiln -name '*.proto' -print0 | sort -z | while IFS= read -r -d '' proto; do
    args=(-I src --python_out=src --pyi_out=src)
    # Only files that declare a service need gRPC stubs.
    if grep -qE '^[[:space:]]*service[[:space:]]' "$proto"; then
        args+=(--grpc_python_out=src)
    fi
    echo "protoc ${proto}"
    "$PYTHON" -m grpc_tools.protoc "${args[@]}" "$proto"
done
