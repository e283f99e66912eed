"""Serving every task over OpenEnv (``pip install -e ".[serve]"``, ``libratio serve``).

- :mod:`.models`: the Pydantic action, observation and state;
- :mod:`.batcher`: the per-task session pools whose steps are gathered over a short window
  and judged in one batched call;
- :mod:`.environment`: the OpenEnv ``Environment`` (one per session);
- :mod:`.app`: the FastAPI app (OpenEnv's HTTP and ``/ws`` routes, plus the original service's
  ``/fleet/*`` routes with sessions);
- :mod:`.client`: the OpenEnv ``EnvClient`` and a pool over several replicas.
"""
