# The collector: Alertmanager webhook in, directives out (torchvitals-collector on port 9500).
#
#     docker build -f docker/collector.Dockerfile -t torchvitals/collector .     # from the repo root
#     docker run -p 9500:9500 -e TORCHVITALS_WEBHOOK_TOKEN_FILE=/run/secrets/token \
#         -v "$PWD/token:/run/secrets/token:ro" torchvitals/collector
#
# The collector imports no torch, so the image installs the package without it: its other
# dependencies and the collector extra (starlette, uvicorn) come from pyproject.toml through
# docker/collector-requirements.py, which leaves out the training side's (torch, rich, matplotlib).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/torchvitals
ENV PATH=/opt/torchvitals/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md LICENSE py.typed __init__.py __main__.py errors.py lazy.py protocol.py settings.py ./
COPY docker/collector-requirements.py ./docker/
COPY agent ./agent
COPY collector ./collector
COPY supervisor ./supervisor
COPY records ./records
# Those requirements, then the package without its dependencies; then the installers leave
# the environment, so the final image has nothing that builds or installs packages.
RUN python docker/collector-requirements.py pyproject.toml > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && pip install --no-deps . \
 && python -c "import sys, torchvitals.collector, starlette, uvicorn; assert 'torch' not in sys.modules" \
 && torchvitals supervise --help > /dev/null \
 && pip uninstall --yes pip setuptools wheel

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 torchvitals \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/torchvitals \
        --shell /usr/sbin/nologin torchvitals \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/torchvitals \
 && install -d -o 10001 -g 10001 -m 0755 /run/torchvitals
COPY --from=build /opt/torchvitals /opt/torchvitals
ENV PATH=/opt/torchvitals/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TORCHVITALS_COLLECTOR_HOST=0.0.0.0 \
    TORCHVITALS_COLLECTOR_PORT=9500 \
    TORCHVITALS_COLLECTOR_STATE_DIR=/var/lib/torchvitals
USER 10001:10001
WORKDIR /var/lib/torchvitals
VOLUME ["/var/lib/torchvitals"]
EXPOSE 9500
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('TORCHVITALS_COLLECTOR_PORT', '9500'), timeout=3)"]
ENTRYPOINT ["torchvitals-collector"]
