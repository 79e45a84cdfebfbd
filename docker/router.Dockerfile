# syntax=docker/dockerfile:1.7
# bellows-router: the OpenAI-compatible gateway.
#
#   docker build -f docker/router.Dockerfile -t bellows-router:0.1.0 .      (from the repo root)
#
# The binary is built as scripts/ build it: `cargo build --release --locked -p bellows-router`,
# with the workspace's .cargo/config.toml (x86-64-v3). The runtime stage holds the binary, CA
# certificates and a non-root user; no compiler, no package manager cache.

ARG RUST_IMAGE=rust:1.95.0-bookworm
ARG RUNTIME_IMAGE=debian:12.12-slim

FROM ${RUST_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# protoc: etcd-client and the worker contract generate gRPC code at build time.
# DL3008 (pin apt package versions) is ignored: the base image tag pins the Debian release, exact
# package versions would break the build at every Debian point release, and this stage is not shipped.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Cache mounts keep the registry and target dir between builds; the binary is copied out of the
# cache in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p bellows-router \
    && install -D -m 0755 target/release/bellows-router /out/bellows-router

FROM ${RUNTIME_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="bellows-router" \
      org.opencontainers.image.description="Bellows: OpenAI-compatible LLM gateway" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/bellows-router /usr/local/bin/bellows-router
RUN groupadd --system --gid 10001 bellows \
    && useradd --system --uid 10001 --gid bellows --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin bellows
# Every flag of the binary also reads an environment variable; these are its defaults, listed so
# `docker run -e` shows what can be set. BELLOWS_ETCD_ENDPOINTS or BELLOWS_WORKERS must be given.
ENV BELLOWS_LISTEN=0.0.0.0:8080 \
    BELLOWS_CLUSTER=default \
    BELLOWS_ETCD_ENDPOINTS="" \
    BELLOWS_WORKERS="" \
    BELLOWS_POLICY=cache_aware \
    BELLOWS_LOG_FORMAT=json \
    RUST_LOG=info \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
USER 10001:10001
EXPOSE 8080
# /health answers 200 while the process serves HTTP (bash's /dev/tcp: no curl in the image).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${BELLOWS_LISTEN##*:} && printf 'GET /health HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
# SIGTERM: stop accepting, finish in-flight requests, exit.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/bellows-router"]
