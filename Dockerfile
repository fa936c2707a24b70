# syntax=docker/dockerfile:1
#
# thrift-sidecar container image.
#
#   docker build -t thrift-sidecar:0.1.0 .
#   docker run --rm --read-only --cap-drop ALL --security-opt no-new-privileges \
#     -v "$PWD/sidecar.yaml:/etc/thrift-sidecar/sidecar.yaml:ro" thrift-sidecar:0.1.0
#
# Config: mount the YAML at /etc/thrift-sidecar/sidecar.yaml (in Kubernetes, mount the ConfigMap
# as the whole /etc/thrift-sidecar directory, not with subPath, so updates reach the file).
# The image writes nothing at run time: it works with a read-only root filesystem. Only
# `tracing.exporter: jsonl` writes (its `path`): point that at a mounted volume or tmpfs.
# Runs as UID/GID 10001. deploy/README.md has the Kubernetes and compose set-ups.

# Builder and runtime must be the same image: the venv built here is copied as is.
# For reproducible builds pin a digest: --build-arg PYTHON_IMAGE=python:3.11-slim@sha256:...
ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
# builder: wheels for the project and every dependency, compiled here (thrift ships only an
# sdist and builds its C accelerator `fastbinary` only if a compiler is present; otherwise it
# silently falls back to pure Python, so the import check below makes that a build failure).
FROM ${PYTHON_IMAGE} AS builder

# gcc and the libc headers for C extensions (thrift's accelerator, the project's compiled scanner).
# Not version-pinned: Debian's stable security updates replace old versions on the mirrors.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY . /src

# `pip wheel .` builds whatever the project builds (pure Python today, plus any compiled
# extension pyproject/setup declares) together with wheels for all its dependencies.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --wheel-dir /wheels /src

# The runtime venv: no pip inside it; installed only from the wheels just built (no index).
# Then prove the compiled parts are really there (the project's own compiled modules too).
RUN python -m venv --without-pip /opt/venv \
 && pip --python /opt/venv/bin/python install --no-index --no-cache-dir --find-links /wheels \
      /wheels/thrift_sidecar-*.whl \
 && /opt/venv/bin/python -c "import uvloop, proxy.cli; from thrift.protocol import fastbinary; from proxy.codec import _scan, _message; from proxy import _hops, _sockq, _otlp" \
 && /opt/venv/bin/thrift-sidecar --help >/dev/null

# ---------------------------------------------------------------------------------------------
# runtime
FROM ${PYTHON_IMAGE} AS runtime

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="thrift-sidecar" \
      org.opencontainers.image.description="A localhost Thrift proxy sidecar: balancing, retries, timeouts, circuit breaking and per-hop traces" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

# No package installer at run time; a fixed non-root user (UID/GID 10001) that owns nothing.
RUN python -m pip uninstall -y pip setuptools wheel \
 && groupadd --system --gid 10001 sidecar \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin sidecar \
 && mkdir -p /etc/thrift-sidecar

COPY --from=builder /opt/venv /opt/venv

# PYTHONDONTWRITEBYTECODE: never try to write .pyc (the venv's were compiled at install time).
# SIDECAR_HEALTH_URL: what HEALTHCHECK asks; it must match `admin.health_listen` in the config.
ENV PATH="/opt/venv/bin:${PATH}" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SIDECAR_HEALTH_URL=http://127.0.0.1:9902/ready

# No writable working directory is needed.
WORKDIR /

# 9090: the Thrift listener; 9901: admin (/ready /live /metrics /stats /config, loopback by
# default); 9902: health_listen (/ready and /live only, for probes from outside the container).
EXPOSE 9090 9901 9902

USER 10001:10001

# /ready answers 503 until every listener is up and from the start of a drain. Exec form with
# Python's own urllib: the slim image has no curl or wget.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen(os.environ['SIDECAR_HEALTH_URL'], timeout=2).status == 200 else 1)"]

# SIGTERM drains (serve local clients on, /ready 503, exit when they are gone or at
# drain_timeout); a second signal exits at once. Exec form: thrift-sidecar is PID 1 and gets them.
STOPSIGNAL SIGTERM
ENTRYPOINT ["thrift-sidecar"]
CMD ["run", "-c", "/etc/thrift-sidecar/sidecar.yaml"]
