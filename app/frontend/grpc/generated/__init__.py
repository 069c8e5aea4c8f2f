"""Generated code: do not edit. ``bash scripts/gen_grpc.sh`` regenerates every module here
from the .proto files beside them (Triton's grpc_service.proto and model_config.proto,
unchanged; the script names the commit they come from). Excluded from ruff and mypy."""
