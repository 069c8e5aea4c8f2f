# syntax=docker/dockerfile:1
# Stoker's two images, one per target:
#   docker build --target cpu -t stoker:cpu .   Python 3.11 slim, ONNX Runtime on the CPU
#   docker build --target gpu -t stoker:gpu .   NVIDIA's TensorRT image, NGC release 25.10:
#                                               TensorRT 10.13.3, CUDA 13.0.2, Ubuntu 24.04,
#                                               Python 3.12 (driver 580 or a data-center
#                                               compatibility driver); `auto` serves with the
#                                               TensorRT backend (never yet run by the
#                                               project's tests: see README, TensorRT);
#                                               STOKER_MODELS__BACKEND=torch for the torch one
# Both run as a non-root user, take STOKER_* settings from the environment, keep the engine
# store on the volume /var/cache/stoker (a restarted container loads instead of rebuilding),
# and carry the default model prepared at build time, so they start offline.
#   docker run -p 8000:8000 -p 8001:8001 -v stoker-engines:/var/cache/stoker stoker:cpu

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG TENSORRT_IMAGE=nvcr.io/nvidia/tensorrt:25.10-py3

# -- cpu ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu-build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY engines ./engines
COPY zoo ./zoo
COPY bench ./bench
COPY docker/install.sh ./docker/install.sh
RUN sh docker/install.sh /opt/stoker/venv /src default-model,tracing
COPY models /opt/stoker/models
RUN /opt/stoker/venv/bin/stoker prepare --repository /opt/stoker/models --model efficientnet_lite0

FROM ${PYTHON_IMAGE} AS cpu
RUN groupadd --system --gid 10001 stoker \
    && useradd --system --uid 10001 --gid stoker --no-create-home --home-dir /var/cache/stoker \
       --shell /usr/sbin/nologin stoker \
    && install -d -o stoker -g stoker -m 0750 /var/cache/stoker
COPY --from=cpu-build /opt/stoker /opt/stoker
ENV PATH=/opt/stoker/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/var/cache/stoker \
    STOKER_SERVER__HOST=0.0.0.0 \
    STOKER_SERVER__PORT=8000 \
    STOKER_SERVER__GRPC_PORT=8001 \
    STOKER_MODELS__REPOSITORY=/opt/stoker/models \
    STOKER_MODELS__PREPARE_MISSING=false \
    STOKER_STORE__PATH=/var/cache/stoker/engines
VOLUME ["/var/cache/stoker"]
USER 10001:10001
# HTTP, and the KServe V2 / Triton gRPC API.
EXPOSE 8000 8001
# Ready, not merely live: engines can take minutes to build the first time, hence the start period.
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('STOKER_SERVER__PORT', '8000')}/v2/health/ready\", timeout=2)"]
ENTRYPOINT ["stoker"]
CMD ["serve"]

# -- gpu ------------------------------------------------------------------------------------
FROM ${TENSORRT_IMAGE} AS gpu-build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's venv module comes from the base image's distribution, which the pinned tag fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY engines ./engines
COPY zoo ./zoo
COPY bench ./bench
COPY docker/install.sh ./docker/install.sh
# The gpu extra: torch (a CUDA build with its own CUDA libraries), torchvision (nvJPEG),
# cuda-python and NVML, for the torch backend, GPU decoding of uploads and the GPU gauges;
# --system-site-packages keeps the base image's TensorRT Python bindings importable.
RUN sh docker/install.sh /opt/stoker/venv /src default-model,gpu,tracing --system-site-packages

FROM ${TENSORRT_IMAGE} AS gpu
RUN groupadd --system --gid 10001 stoker \
    && useradd --system --uid 10001 --gid stoker --no-create-home --home-dir /var/cache/stoker \
       --shell /usr/sbin/nologin stoker \
    && install -d -o stoker -g stoker -m 0750 /var/cache/stoker
COPY --from=gpu-build /opt/stoker/venv /opt/stoker/venv
# The prepared default model is plain ONNX: the same files as in the cpu image.
COPY --from=cpu-build /opt/stoker/models /opt/stoker/models
ENV PATH=/opt/stoker/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/var/cache/stoker \
    STOKER_SERVER__HOST=0.0.0.0 \
    STOKER_SERVER__PORT=8000 \
    STOKER_SERVER__GRPC_PORT=8001 \
    STOKER_MODELS__REPOSITORY=/opt/stoker/models \
    STOKER_MODELS__PREPARE_MISSING=false \
    STOKER_STORE__PATH=/var/cache/stoker/engines
VOLUME ["/var/cache/stoker"]
USER 10001:10001
# HTTP, and the KServe V2 / Triton gRPC API.
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('STOKER_SERVER__PORT', '8000')}/v2/health/ready\", timeout=2)"]
ENTRYPOINT ["stoker"]
CMD ["serve"]
