# A training image: torch, the torchvitals agent and supervisor, and the examples.
#
#     docker build -f docker/trainer.Dockerfile -t torchvitals/trainer .        # CPU torch
#     docker build -f docker/trainer.Dockerfile -t torchvitals/trainer:cu128 \
#         --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .  # CUDA 12.8 torch
#
# Choose the CUDA index that matches the hosts' NVIDIA driver (https://pytorch.org/get-started);
# the wheels bundle the CUDA runtime, so the base image stays python:slim and the host needs only
# the driver and the NVIDIA container toolkit. By default it runs the demo job:
# `torchvitals supervise -- torchrun --nproc-per-node 2 /app/examples/ddp_train.py`; pass your
# own command (`torchvitals supervise --checkpoint-dir /checkpoints -- torchrun ... train.py`).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/torchvitals
ENV PATH=/opt/torchvitals/bin:$PATH
# The same range as pyproject.toml (no upper bound: the index's newest torch from 2.13 on),
# from the chosen index: a bare `pip install torch` would take PyPI's CUDA build. The package
# below then keeps it. Build FROM an NGC image instead and its torch (2.13.0a0+git...) is kept.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.13.0a0"
WORKDIR /src
COPY pyproject.toml README.md LICENSE py.typed __init__.py __main__.py errors.py lazy.py protocol.py settings.py ./
COPY agent ./agent
COPY collector ./collector
COPY supervisor ./supervisor
COPY records ./records
RUN pip install ".[data]" \
 && pip uninstall --yes pip setuptools wheel

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 torchvitals \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /workspace \
        --shell /usr/sbin/nologin torchvitals \
 && install -d -o 10001 -g 10001 /workspace /checkpoints
COPY --from=build /opt/torchvitals /opt/torchvitals
COPY examples/quickstart.py examples/ddp_train.py /app/examples/
ENV PATH=/opt/torchvitals/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/workspace \
    TORCHVITALS_METRICS_HOST=0.0.0.0 \
    TORCHVITALS_METRICS_PORT=19400 \
    TORCHVITALS_CHECKPOINT_DIR=/checkpoints \
    TORCHVITALS_LOG_DIR=/checkpoints/runs
USER 10001:10001
WORKDIR /workspace
VOLUME ["/checkpoints"]
# Rank r of the node serves /metrics on 19400 + r (outside the exporters' 9100-9999: a node's
# dcgm-exporter keeps 9400).
EXPOSE 19400-19407
# Local rank 0's /metrics: it answers once the job has started (torch imported, rendezvous done).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/metrics' % os.environ.get('TORCHVITALS_METRICS_PORT', '19400'), timeout=3)"]
CMD ["torchvitals", "supervise", "--checkpoint-dir", "/checkpoints", "--", \
     "torchrun", "--nproc-per-node", "2", "/app/examples/ddp_train.py", "--steps", "0", "--sleep", "0.2"]
