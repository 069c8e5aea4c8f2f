#!/usr/bin/env bash
# Regenerate the gRPC code of app/frontend/grpc/generated/ from the .proto files beside it:
#
#   bash scripts/gen_grpc.sh                     (from anywhere; needs .venv with the dev extra)
#   PYTHON=/path/to/python bash scripts/gen_grpc.sh
#
# The protos are Triton's, unchanged: grpc_service.proto and model_config.proto of
# github.com/triton-inference-server/common, protobuf/, at commit
# 83adf7cf88a2f343005974dff3728be746de2d66 (2026-07-23). They are compiled from that folder so
# each file keeps the name Triton gives it ("grpc_service.proto"): tritonclient.grpc registers
# the very same descriptors, and both load in one process. protoc writes top-level imports
# (`import model_config_pb2`); they are made package imports afterwards. No service stubs are
# generated: app/frontend/grpc/server.py registers its handlers from the descriptor (the
# inference methods take wire bytes). grpcio-tools is pinned in pyproject.toml's dev extra,
# so the output is the same on every machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=app/frontend/grpc/generated
PACKAGE=app.frontend.grpc.generated

"$PYTHON" -m grpc_tools.protoc -I "$OUT" --python_out="$OUT" --pyi_out="$OUT" \
    "$OUT/grpc_service.proto" "$OUT/model_config.proto"
sed -i "s/^import model_config_pb2 as /from $PACKAGE import model_config_pb2 as /" \
    "$OUT/grpc_service_pb2.py" "$OUT/grpc_service_pb2.pyi"
echo "regenerated $OUT"
