# syntax=docker/dockerfile:1
#
# Tailguard, the latency-aware LLM API gateway.
#
#   docker build -t tailguard .
#   docker run --rm -p 127.0.0.1:8080:8080 -e TAILGUARD_SERVER__ALLOW_UNAUTHENTICATED=true \
#       tailguard                                                  # built-in simulated models
#   docker run --rm -p 127.0.0.1:8080:8080 -e OPENAI_API_KEY \
#       -v "$PWD/config/examples/openai.yaml:/etc/tailguard/gateway.yaml:ro" tailguard
#   docker run --rm tailguard check-config --config /etc/tailguard/examples/mixed.yaml
#   docker run --rm -p 127.0.0.1:8000:8000 tailguard sim --host 0.0.0.0   # simulated upstream
#
# The entrypoint is `tailguard`; the default command serves /etc/tailguard/gateway.yaml on
# 0.0.0.0:8080, which a config without API keys may only do when told so (as above). Mount your own config over that path; pass secrets as environment variables
# (the config refers to them as ${OPENAI_API_KEY}, ${ANTHROPIC_API_KEY}, ...).

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: the tailguard wheel plus a wheel for every dependency ---------------------------------
FROM ${PYTHON_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN pip wheel --wheel-dir /wheels .

# --- runtime: a venv holding only tailguard and its dependencies, run as a non-root user ----------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="tailguard" \
      org.opencontainers.image.description="A latency-aware LLM API gateway that keeps the slowest requests fast." \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/tailguard/bin:$PATH \
    TAILGUARD_CONFIG=/etc/tailguard/gateway.yaml

RUN groupadd --system --gid 10001 tailguard \
 && useradd --system --uid 10001 --gid tailguard --create-home --home-dir /home/tailguard \
        --shell /usr/sbin/nologin tailguard

# The venv gets no pip of its own: the base image's pip installs into it from the build stage's
# wheels (mounted, not copied, so they add no layer), offline. Byte code is compiled at install
# time, since the non-root user cannot write __pycache__ at run time.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv --without-pip /opt/tailguard \
 && pip --python /opt/tailguard/bin/python install --no-index --find-links /wheels tailguard \
 && tailguard --help > /dev/null

# The embedded default config (in-process simulated models, no keys) and the documented examples.
COPY gateway/config/gateway.yaml /etc/tailguard/gateway.yaml
COPY config/examples/ /etc/tailguard/examples/

USER 10001:10001
WORKDIR /home/tailguard
EXPOSE 8080

# Liveness from inside the container with Python's urllib (slim images have no curl), ignoring any
# HTTP(S)_PROXY variables. Follows TAILGUARD_SERVER__PORT if the port is moved that way.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/healthz' % os.environ.get('TAILGUARD_SERVER__PORT', '8080'), timeout=2)"]

ENTRYPOINT ["tailguard"]
CMD ["serve", "--host", "0.0.0.0", "--config", "/etc/tailguard/gateway.yaml"]
