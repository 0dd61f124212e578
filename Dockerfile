# syntax=docker/dockerfile:1
# The splitinfer cloud image: gateway, planner API, Ray head/workers and the
# edge agent all run from it (`splitinfer <subcommand>`).
#   docker build -t splitinfer/splitinfer:0.1.0 .
# See docs/deploy-kubernetes.md.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . .
# Installed under a prefix that the runtime stage copies onto /usr/local, not
# into a virtualenv: KubeRay starts Ray with `bash -lc`, and Debian's
# /etc/profile resets PATH for login shells, which would hide a venv's `ray`.
RUN pip install --prefix=/install ".[cloud]"

FROM python:3.11-slim
# wget: KubeRay's default liveness/readiness probes on Ray pods exec it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/*
# The numeric user matches the chart's runAsUser, so runAsNonRoot can verify it.
RUN groupadd --gid 10001 splitinfer \
 && useradd --uid 10001 --gid 10001 --create-home --shell /bin/bash splitinfer
COPY --from=build /install /usr/local
# Bytecode was compiled at install time; the chart runs with a read-only root.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/splitinfer
# gRPC gateway, metrics/health, planner API, edge-agent local API.
EXPOSE 50051 9090 8080 8500
ENTRYPOINT ["splitinfer"]
CMD ["--help"]
