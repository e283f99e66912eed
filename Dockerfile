# libratio_jax served over OpenEnv, for a Hugging Face Space (CPU) or any container host.
#   docker build -t libratio-jax .
#   docker run -p 8000:8000 libratio-jax
# Spaces route traffic to port 7860 by default: the app_port in openenv.yaml / README front
# matter says 8000, or run with -e PORT=7860.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    JAX_PLATFORMS=cpu PORT=8000 MAX_SESSIONS=256
WORKDIR /app
COPY pyproject.toml setup.py README.md LICENSE ./
COPY src ./src
# g++ builds the native CPU kernels (libratio_jax.physics._native; without it the package
# runs their XLA forms), then goes; libstdc++6, which the kernels load, stays.
RUN apt-get update && apt-get install -y --no-install-recommends g++ libstdc++6 \
    && pip install --upgrade pip && pip install ".[serve]" \
    && python -c "from libratio_jax.physics import native; print(native.status())" \
    && apt-get purge -y g++ && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home appuser
USER appuser
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
    CMD python -c "import urllib.request, os; urllib.request.urlopen('http://127.0.0.1:' + os.environ['PORT'] + '/health')"
CMD ["sh", "-c", "libratio serve --host 0.0.0.0 --port ${PORT} --max-sessions ${MAX_SESSIONS}"]
