# One image for web, worker, beat and the gpubox worker. The gpubox worker runs the trainer on the
# host's GPUs (see docker-compose.yml); torch is the build named in requirements.txt.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TRAINBOARD_VAR_DIR=/var/lib/trainboard
RUN apt-get update && apt-get install -y --no-install-recommends npm && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt package.json package-lock.json ./
RUN pip install --no-cache-dir -r requirements.txt && npm ci --omit=dev --no-audit --no-fund
COPY . .
RUN useradd --create-home trainboard && mkdir -p /var/lib/trainboard && chown trainboard /var/lib/trainboard
USER trainboard
EXPOSE 8000
CMD ["gunicorn", "webapp.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "3"]
