"""Start ``libratio serve`` in a child process (tests, benchmarks, local replicas for
:class:`~libratio_jax.serve.client.ClientPool`).

    >>> with local_server("--max-sessions", "64") as url:  # doctest: +SKIP
    ...     httpx.get(url + "/health").json()["status"]
    'ok'
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(*args: str, startup_seconds: float = 120.0, stderr=None):
    """``libratio serve --port P *args`` on a free port; yields its URL once ``/health``
    answers, stops it on exit. RuntimeError with the server's last output if it dies first.
    Its output goes to ``stderr`` (a binary file open for writing and reading, e.g. to
    read the server's log after), else to a temporary file (a pipe nobody reads would fill
    up and stall it)."""
    import httpx

    port = free_port()
    log = tempfile.TemporaryFile() if stderr is None else stderr
    proc = subprocess.Popen([sys.executable, "-m", "libratio_jax", "serve", "--port", str(port),
                             *args], stdout=subprocess.DEVNULL, stderr=log,
                            env={**os.environ, "JAX_PLATFORMS": os.environ.get(
                                "JAX_PLATFORMS", "cpu")})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_seconds
        # One client for the polls (a one-off httpx.get builds an SSL context each time,
        # ~30 ms of CPU that the starting server could use).
        with httpx.Client(timeout=1.0) as client:
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError("libratio serve did not start:\n"
                                       + log.read().decode(errors="replace")[-2000:])
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + "/health").status_code == 200:
                        break
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if stderr is None:
            log.close()
