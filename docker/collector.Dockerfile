# The collector: Alertmanager webhook in, directives out (torchvitals-collector on port 9500).
#
#     docker build -f docker/collector.Dockerfile -t torchvitals/collector .     # from the repo root
#     docker run -p 9500:9500 -e TORCHVITALS_WEBHOOK_TOKEN_FILE=/run/secrets/token \
#         -v "$PWD/token:/run/secrets/token:ro" torchvitals/collector
#
# The package's __init__ imports torch, so the image carries the CPU build of torch (the
# collector never touches a GPU; a CUDA build would add gigabytes).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/torchvitals
ENV PATH=/opt/torchvitals/bin:$PATH
# The same pin as pyproject.toml, from the CPU index: PyPI's default Linux wheel is the CUDA one.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.13,<2.14"
WORKDIR /src
COPY pyproject.toml README.md __init__.py __main__.py ./
COPY agent ./agent
COPY collector ./collector
# pip resolves the other dependencies from PyPI and keeps the torch above; then the installers
# leave the environment, so the final image has nothing that builds or installs packages.
RUN pip install . \
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
