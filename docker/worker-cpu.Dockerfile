# syntax=docker/dockerfile:1.7
# bellows-worker for CPUs: the engine and gRPC node, no GPU code.
#
#   docker build -f docker/worker-cpu.Dockerfile -t bellows-worker-cpu:0.1.0 .      (from the repo root)
#
# The binary is built as scripts/ build it: `cargo build --release --locked -p bellows-worker`, with
# the workspace's .cargo/config.toml (x86-64-v3: AVX2/FMA kernels, 2.5x faster decoding; every x86-64
# server CPU of the last decade has it). The model is not in the image: mount it (the Helm chart
# does) at /models/SmolLM2-135M-Instruct.Q4_1.gguf, or set BELLOWS_MODEL; or run --engine sim.

ARG RUST_IMAGE=rust:1.95.0-bookworm
ARG RUNTIME_IMAGE=debian:12.12-slim

FROM ${RUST_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# protoc: the worker contract and etcd-client generate gRPC code at build time.
# DL3008 (pin apt package versions) is ignored: the base image tag pins the Debian release, exact
# package versions would break the build at every Debian point release, and this stage is not shipped.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p bellows-worker \
    && install -D -m 0755 target/release/bellows-worker /out/bellows-worker

FROM ${RUNTIME_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="bellows-worker-cpu" \
      org.opencontainers.image.description="Bellows model worker (CPU)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/bellows-worker /usr/local/bin/bellows-worker
# /models: where the model is mounted; owned by the worker's user so a volume-less run can fill it.
RUN groupadd --system --gid 10001 bellows \
    && useradd --system --uid 10001 --gid bellows --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin bellows \
    && install -d -o 10001 -g 10001 /models
# Every flag of `bellows-worker serve` also reads an environment variable; these are its defaults
# (the drain timeout included), listed so `docker run -e` shows what can be set. Give
# BELLOWS_ETCD_ENDPOINTS to register with routers; without it the node serves unregistered.
ENV BELLOWS_ENGINE=gguf \
    BELLOWS_MODEL_DIR=/models \
    BELLOWS_LISTEN=0.0.0.0:50051 \
    BELLOWS_METRICS_LISTEN=0.0.0.0:9091 \
    BELLOWS_ETCD_ENDPOINTS="" \
    BELLOWS_CLUSTER=default \
    BELLOWS_LEASE_TTL=5s \
    BELLOWS_DRAIN_TIMEOUT=30s \
    BELLOWS_LOG_FORMAT=json \
    RUST_LOG=info \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
USER 10001:10001
EXPOSE 50051 9091
# The gRPC port accepts connections from start-up on (readiness, "model loaded", is gRPC health,
# which Kubernetes probes natively; the image has no gRPC client). bash's /dev/tcp: no extra tools.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${BELLOWS_LISTEN##*:}"]
# SIGTERM: deregister, refuse new work, finish in-flight requests (BELLOWS_DRAIN_TIMEOUT), exit.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/bellows-worker"]
CMD ["serve"]
