# One image for every Trainboard service of docker-compose.yml: web (gunicorn, static files served by
# whitenoise), the Celery worker and beat, the GPU box's worker and runner (the runner's processes run
# the training; docs/docker.md), flower.
#
#   docker build -t trainboard .                              # torch's CUDA build (PyPI's torch==2.13.0)
#   docker build --build-arg TORCH_VARIANT=cpu -t trainboard .  # torch's CPU build: a much smaller image
#
# TORCH_VARIANT=cuda is the default: the GPU box exists to train on NVIDIA GPUs. For cpu, a
# torch-2.13.0+cpu wheel in .wheels/ of the build context (git-ignored; CI puts the one it has there)
# is installed, else the same version from the PyTorch CPU index. Every other package is the exact
# pin of requirements-lock.txt (requirements.txt and everything it pulls in; scripts/lock-requirements.sh);
# the CUDA build's own dependencies (nvidia-*, triton) are pinned exactly by torch itself.

# The Python base, pinned to one release (docker/bases/images lists it with PostgreSQL's and Redis's).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# --- deps: the virtualenv and the npm packages, from the pinned requirements only -----------------
# Its layers change only with requirements*.txt, package*.json or the torch wheel, never with the source;
# CI keeps this stage as its layer cache (tests/e2e/test_compose_stack.py).
FROM ${PYTHON_IMAGE} AS deps
ARG TORCH_VARIANT=cuda
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# npm only here: Chart.js and its plugins (package-lock.json) are collected as static files below.
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends npm \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /build
# .wheel[s]: the directory's wheels when it exists, nothing otherwise (requirements.txt always matches).
COPY requirements.txt requirements-lock.txt .wheel[s] /build/wheels/
RUN set -eu; \
    case "$TORCH_VARIANT" in \
      cpu) wheel="$(ls /build/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1)"; \
           if [ -n "$wheel" ]; then pip install --no-deps "$wheel"; \
           else pip install --no-deps --index-url "$TORCH_CPU_INDEX" "torch==2.13.0+cpu"; fi ;; \
      cuda) ;; \
      *) echo "TORCH_VARIANT must be cpu or cuda, got $TORCH_VARIANT" >&2; exit 1 ;; \
    esac; \
    pip install -r /build/wheels/requirements.txt -c /build/wheels/requirements-lock.txt; \
    pip check; \
    python -c "import torch; print('torch', torch.__version__)"; \
    rm -rf /build/wheels
COPY package.json package-lock.json /app/
RUN cd /app && npm ci --omit=dev --no-audit --no-fund --loglevel=error

# --- builder: the application and its collected static files --------------------------------------
FROM deps AS builder
COPY . /app
# Settings need a key to load; these exist only for collectstatic, never in the image.
RUN cd /app && TRAINBOARD_VAR_DIR=/build/var DJANGO_SECRET_KEY=collectstatic-only \
    TRAINBOARD_ENCRYPTION_KEY="$(python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())')" \
    python manage.py collectstatic --noinput -v 0 \
 && rm -rf /build/var/secret_key /build/var/encryption_key /app/node_modules /app/.wheels

# --- runtime ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH PYTHONPATH=/app \
    TRAINBOARD_VAR_DIR=/var/lib/trainboard TRAINBOARD_RUN_ROOT=/var/lib/trainboard/runs
# A fixed uid, so volumes keep one owner across rebuilds; the directories the volumes mount.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin trainboard \
 && mkdir -p /var/lib/trainboard/runs /var/lib/trainboard/datasets /var/lib/trainboard/code \
             /var/lib/trainboard/runner /var/lib/trainboard/staticfiles \
 && chown -R trainboard:trainboard /var/lib/trainboard
COPY --from=deps /opt/venv /opt/venv
COPY --from=builder --chown=trainboard:trainboard /build/var/staticfiles /var/lib/trainboard/staticfiles
COPY --from=builder /app /app
WORKDIR /app
USER trainboard
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=5 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
CMD ["gunicorn", "webapp.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "3"]
