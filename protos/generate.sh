#!/usr/bin/env bash
# Regenerate the Python modules for protos/*.proto (run from anywhere; needs grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protos/specdec_api.proto protos/specdec_tree.proto
