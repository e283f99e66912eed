# libratio_jax served over OpenEnv, for a Hugging Face Space (CPU) or any container host.
#   docker build -t libratio-jax .
#   docker run -p 8000:8000 libratio-jax
# Spaces route traffic to port 7860 by default: the app_port in openenv.yaml / README front
# matter says 8000, or run with -e PORT=7860.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    JAX_PLATFORMS=cpu PORT=8000 MAX_SESSIONS=256
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
RUN pip install --upgrade pip && pip install ".[serve]"
RUN useradd --create-home appuser
USER appuser
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
    CMD python -c "import urllib.request, os; urllib.request.urlopen('http://127.0.0.1:' + os.environ['PORT'] + '/health')"
CMD ["sh", "-c", "libratio serve --host 0.0.0.0 --port ${PORT} --max-sessions ${MAX_SESSIONS}"]
