# pagedserve image: the `pagedserve` console script (router, executor, serve, generate, ...).
#
# CPU (default):
#   docker build -t pagedserve .
# CUDA: the torch CUDA wheels carry their own CUDA runtime, so the slim base works on a host
# with the NVIDIA container toolkit; INSTALL_CC=1 adds the C compiler Triton needs to build
# its kernel launchers at run time. A CUDA base image works too (python3 is installed there):
#   docker build -t pagedserve:cu128 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg INSTALL_CC=1 .
#   docker build -t pagedserve:cu128 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg INSTALL_CC=1 .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG INSTALL_CC=0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# python3 + venv where the base has none (CUDA images); gcc for Triton on CUDA when asked.
RUN set -eux; \
    pkgs=""; \
    command -v python3 >/dev/null || pkgs="python3 python3-venv"; \
    [ "$INSTALL_CC" = "1" ] && pkgs="$pkgs gcc libc6-dev"; \
    if [ -n "$pkgs" ]; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/venv

# torch first, from the chosen index (a plain resolve would pull a multi-GB CUDA build);
# constraints.txt then pins it while the project installs.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY pagedserve ./pagedserve
COPY protos ./protos
COPY kvmanager ./kvmanager
COPY router ./router
COPY executor ./executor
COPY kernels ./kernels
RUN pip install -c constraints.txt . && rm -rf /src/build

# Unprivileged; models are mounted read-only at /models (PAGEDSERVE_MODEL=/models/<name>).
RUN useradd --create-home --uid 10001 pagedserve && mkdir -p /models
USER pagedserve
WORKDIR /home/pagedserve

# gRPC, Prometheus /metrics, the router's ZeroMQ socket for executors. Executors open none.
EXPOSE 50051 8000 9400 5557

ENTRYPOINT ["pagedserve"]
CMD ["--help"]
