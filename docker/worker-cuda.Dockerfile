# syntax=docker/dockerfile:1.7
# bellows-worker for NVIDIA GPUs: `--features cuda` (candle's CUDA backend), CUDA 13.0.
#
#   docker build -f docker/worker-cuda.Dockerfile -t bellows-worker-cuda:0.1.0 \
#       --build-arg CUDA_COMPUTE_CAP=90 .                                       (from the repo root)
#
# Built as scripts/build-cuda.sh builds it: `cargo build --release --locked -p bellows-worker
# --features cuda` with nvcc 13.0 and CUDA_COMPUTE_CAP (90: Hopper, sm_90a; 89: Ada; 80: Ampere
# A100; one architecture per image). Here the CUDA toolkit comes from NVIDIA's devel image and the
# Rust toolchain from the official Rust image (the same version as for the CPU images), and libcuda
# links against the toolkit's stub; the real libcuda.so.1 comes from the node's driver at run time
# (NVIDIA container toolkit; driver >= 580 for CUDA 13.0). Stay on 13.0.x: newer nvcc emits PTX that
# driver 580 may reject.

ARG RUST_IMAGE=rust:1.95.0-bookworm
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

FROM ${RUST_IMAGE} AS rust

FROM ${CUDA_DEVEL_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG CUDA_COMPUTE_CAP=90
# protoc for gRPC code generation; a C/C++ toolchain for nvcc's host code, build scripts and linking.
# DL3008 (pin apt package versions) is ignored: the base image tag pins the Ubuntu release, exact
# package versions would break the build at every Ubuntu update, and this stage is not shipped.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# The Rust toolchain of the official image (built for an older glibc than this image's, so it runs here).
COPY --from=rust /usr/local/cargo /usr/local/cargo
COPY --from=rust /usr/local/rustup /usr/local/rustup
ENV CARGO_HOME=/usr/local/cargo \
    RUSTUP_HOME=/usr/local/rustup \
    PATH=/usr/local/cargo/bin:/usr/local/cuda/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    CUDA_PATH=/usr/local/cuda \
    NVCC=/usr/local/cuda/bin/nvcc \
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib64/stubs
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    nvcc --version \
    && cargo build --release --locked -p bellows-worker --features cuda \
    && install -D -m 0755 target/release/bellows-worker /out/bellows-worker

# The runtime image has the CUDA libraries the binary links (libcudart, libcublas, libcublasLt,
# libcurand); no compiler, no headers.
FROM ${CUDA_RUNTIME_IMAGE}
ARG VERSION=0.1.0
ARG CUDA_COMPUTE_CAP=90
LABEL org.opencontainers.image.title="bellows-worker-cuda" \
      org.opencontainers.image.description="Bellows model worker (NVIDIA CUDA 13.0)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.bellows.cuda-compute-cap="${CUDA_COMPUTE_CAP}"
COPY --from=build /out/bellows-worker /usr/local/bin/bellows-worker
# /models: where the model is mounted; owned by the worker's user so a volume-less run can fill it.
RUN groupadd --system --gid 10001 bellows \
    && useradd --system --uid 10001 --gid bellows --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin bellows \
    && install -d -o 10001 -g 10001 /models
# Every flag of `bellows-worker serve` also reads an environment variable; these are its defaults,
# listed so `docker run -e` shows what can be set. The base image's NVIDIA_DRIVER_CAPABILITIES
# (compute,utility) makes the container toolkit mount the driver's libcuda.so.1.
ENV BELLOWS_ENGINE=gguf \
    BELLOWS_MODEL_DIR=/models \
    BELLOWS_LISTEN=0.0.0.0:50051 \
    BELLOWS_METRICS_LISTEN=0.0.0.0:9091 \
    BELLOWS_ETCD_ENDPOINTS="" \
    BELLOWS_CLUSTER=default \
    BELLOWS_LEASE_TTL=5s \
    BELLOWS_DRAIN_TIMEOUT=30s \
    BELLOWS_LOG_FORMAT=json \
    RUST_LOG=info
USER 10001:10001
EXPOSE 50051 9091
# The gRPC port accepts connections from start-up on (readiness, "model loaded", is gRPC health,
# which Kubernetes probes natively; the image has no gRPC client). bash's /dev/tcp: no extra tools.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${BELLOWS_LISTEN##*:}"]
# SIGTERM: deregister, refuse new work, finish in-flight requests (BELLOWS_DRAIN_TIMEOUT), exit.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/bellows-worker"]
CMD ["serve"]
