"""The served app: OpenEnv's routes (``/ws`` sessions, ``/reset``, ``/step``, ``/state``,
``/schema``, ``/metadata``) for :class:`~libratio_jax.serve.environment.LibratioEnvironment`,
and the original service's routes with sessions:

- ``GET /health`` -> ``{"status": "ok", "environment", "version", "active_sessions"}``;
- ``GET /fleet/tasks`` -> ``[{"id", "task_id", "description", "difficulty", "max_steps"}]``;
- ``POST /fleet/reset`` ``{"task_id": "fleet_precision", "seed": 3}`` -> ``{"observation":
  {...}, "session_id"}`` (also set as the ``libratio_session`` cookie);
- ``POST /fleet/step`` ``{"action": {...}}`` (or the bare action; ``{"reply": "text"}`` sends
  text) -> ``{"observation": {...} | null, "reward": {"score", "feedback"}, "done", "info"}``;
- ``POST /fleet/state`` -> ``{"task_id", "current_task", "current_scenario_id",
  "step_number", "is_done", "history"}``;
- ``POST /fleet/session`` -> ``{"session_id"}``: a fresh id (also set as the cookie).

A ``/fleet`` request names its session with the ``X-Session-Id`` header or the cookie; one
with neither uses the default session (as the original's one global environment, for its
one-off ``httpx.post`` clients). Sessions idle longer than ``idle_seconds`` are evicted.
Every refusal is a 4xx with a JSON ``{"detail": message}`` naming the problem; bodies over
``max_body_bytes`` are refused with 413 before they are read (by their ``Content-Length``;
one sent without it is read only up to the limit: 413, or the route's own 4xx). A session's
``/fleet`` history keeps each step's reply, not the rest of its body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request, WebSocketDisconnect
from fastapi.responses import JSONResponse
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.types import ConcurrencyConfig
from starlette.websockets import WebSocketDisconnected

from libratio_jax.serve.batcher import ORIGINAL_TASKS, Hub, ServeError
from libratio_jax.serve.environment import LibratioEnvironment, check_seed
from libratio_jax.serve.models import MAX_REPLY_CHARS, LibratioAction, LibratioObservation

COOKIE = "libratio_session"
HEADER = "X-Session-Id"
DEFAULT_SESSION = "default"
MAX_BODY_BYTES = 1 << 20
_DESCRIPTIONS = {
    "fleet_precision": ("Choose a precision strategy per model of a fleet", "easy"),
    "fleet_resource": ("Allocate GPUs and precisions to the models of a fleet", "medium"),
    "fleet_oversight": ("Watch loss curves and flag the run that crashes", "medium"),
    "fleet_recovery": ("Diagnose a crash, reallocate, verify", "hard"),
}


class _Sessions:
    """The ``/fleet`` routes' sessions: id -> environment, with a limit and idle eviction.
    A session is idle from the end of its last request (:meth:`using`); one with a request
    in flight is never evicted, however long the request takes (a first reset compiles)."""

    def __init__(self, hub: Hub, limit: int, idle_seconds: float | None):
        self.hub = hub
        self.limit = limit
        self.idle_seconds = idle_seconds
        self._envs: dict[str, LibratioEnvironment] = {}
        self._seen: dict[str, float] = {}
        self._busy: dict[str, int] = {}  # requests in flight per session
        self._history: dict[str, list] = {}

    def evict_idle(self) -> None:
        if self.idle_seconds is None:
            return
        now = time.monotonic()
        for sid in [s for s, t in self._seen.items()
                    if now - t > self.idle_seconds and s not in self._busy]:
            self.drop(sid)

    @contextlib.contextmanager
    def using(self, sid: str, *, create: bool):
        """:meth:`get` for one request: the session is not evicted while the request runs,
        and its idle time counts from the request's end."""
        env = self.get(sid, create=create)
        self._busy[sid] = self._busy.get(sid, 0) + 1
        try:
            yield env
        finally:
            left = self._busy.pop(sid) - 1
            if left:
                self._busy[sid] = left
            if sid in self._envs:
                self._seen[sid] = time.monotonic()

    def drop(self, sid: str) -> None:
        env = self._envs.pop(sid, None)
        self._seen.pop(sid, None)
        self._history.pop(sid, None)
        if env is not None:
            env.close()

    def get(self, sid: str, *, create: bool) -> LibratioEnvironment:
        self.evict_idle()
        if sid not in self._envs:
            if not create and sid == DEFAULT_SESSION:
                raise ServeError("step before reset: start an episode with POST /fleet/reset",
                                 409)
            if not create:
                raise ServeError(f"unknown session {sid!r}: start one with POST /fleet/reset",
                                 404)
            if len(self._envs) >= self.limit:
                raise ServeError(f"all {self.limit} sessions are in use; retry later", 503)
            self._envs[sid] = LibratioEnvironment(self.hub)
            self._history[sid] = []
        self._seen[sid] = time.monotonic()
        return self._envs[sid]

    def history(self, sid: str) -> list:
        return self._history.setdefault(sid, [])

    def __len__(self) -> int:
        return len(self._envs)

    def __contains__(self, sid: str) -> bool:
        return sid in self._envs


async def _json_body(request: Request, limit: int) -> Any:
    raw = bytearray()
    async for chunk in request.stream():  # (bodies without a Content-Length too)
        raw += chunk
        if len(raw) > limit:
            raise ServeError(f"the body is over {limit} bytes", 413)
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ServeError(f"the body is not valid JSON ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None


def _session_id(request: Request) -> str | None:
    return request.headers.get(HEADER) or request.cookies.get(COOKIE)


class _QuietDisconnect:
    """ASGI middleware: a WebSocket whose client has gone is not a server error.
    openenv-core 0.3's ``/ws`` endpoint destroys the session, then closes the socket and
    catches only ``RuntimeError``; when the client has already closed it, Starlette raises
    ``WebSocketDisconnect`` there instead, and uvicorn logged "Exception in ASGI application"
    with a traceback at the end of every normal client session. The session is gone by
    then, so nothing is left to do."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected):
            await self.app(scope, receive, send)


# The deepest JSON a /ws frame may nest (an action nests a few levels): deeper, Python's
# json.loads, which openenv-core calls, nears its recursion limit and raises RecursionError.
MAX_FRAME_DEPTH = 64


def _depth(value) -> int:
    """The nesting depth of a parsed JSON value (1 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def _frame_problem(message: dict) -> str | None:
    """Why a ``websocket.receive`` message cannot go to openenv-core's ``/ws`` loop, or None."""
    text = message.get("text")
    if text is None:
        return "a binary frame"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return "text that is not JSON"
    if not isinstance(value, dict):
        return "JSON that is not an object"
    if _depth(value) > MAX_FRAME_DEPTH:
        return f"JSON nested deeper than {MAX_FRAME_DEPTH} levels"
    return None


class _ObjectFrames:
    """ASGI middleware: a ``/ws`` frame that is not a JSON object in text, within
    ``MAX_FRAME_DEPTH`` levels, is answered here with an error frame (``INVALID_JSON``, the
    code openenv-core gives text that is not JSON) and not passed on, so the session and its
    episode go on. openenv-core 0.3's loop ends the session on a binary frame (it reads text
    only), on JSON that is not an object (it calls ``.get`` on it) and on JSON nested deep
    enough that ``json.loads`` raises ``RecursionError``. The frame is parsed once more for
    it (a few microseconds for an action)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):  # (served under a root path: the route's own)
            path = path[len(root):]
        if scope["type"] != "websocket" or path != "/ws":
            return await self.app(scope, receive, send)

        async def objects_only():
            while True:
                message = await receive()
                if message["type"] != "websocket.receive":
                    return message
                problem = _frame_problem(message)
                if problem is None:
                    return message
                await send({"type": "websocket.send", "text": json.dumps({
                    "type": "error",
                    "data": {"message": f"{problem}: send one JSON object per text frame, "
                                        'e.g. {"type": "reset", "data": {}}',
                             "code": "INVALID_JSON"}})})

        await self.app(scope, objects_only, send)


class _BodyTooLarge(Exception):
    pass


class _LimitBody:
    """ASGI middleware: a request body over ``limit`` bytes is refused with 413, by its
    ``Content-Length`` before it is read, and, without one (chunked), once the bytes read
    pass the limit: OpenEnv's own routes read whole bodies."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._refuse(scope, receive, send)
        read, started = 0, False

        async def counted():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.limit:
                    raise _BodyTooLarge
            return message

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except _BodyTooLarge:
            if not started:
                await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        response = JSONResponse({"detail": f"the body is over {self.limit} bytes"},
                                status_code=413)
        await response(scope, receive, send)


def build_app(*, max_sessions: int = 256, window_seconds: float | None = 0.002,
              idle_seconds: float | None = 600.0, max_body_bytes: int = MAX_BODY_BYTES,
              overrides: dict | None = None) -> FastAPI:
    """The app (see the module docstring). ``max_sessions``: sessions per task at once (the
    WebSocket sessions and the ``/fleet`` sessions each at most this many); ``window_seconds``:
    how long steps are gathered into one batched call (``None``: no batching);
    ``idle_seconds``: idle sessions are closed after this long; ``overrides``: ``make``
    overrides of the Fleet envs (e.g. ``bank_size``)."""
    from libratio_jax import __version__, inline_cpu_dispatch

    inline_cpu_dispatch()  # steps are small batches: latency-bound (no effect once JAX is up)
    hub = Hub(max_sessions, window_seconds=window_seconds, overrides=overrides)
    app = create_app(lambda: LibratioEnvironment(hub), LibratioAction, LibratioObservation,
                     env_name="libratio_jax", concurrency_config=ConcurrencyConfig(
                         max_concurrent_envs=max_sessions, session_timeout=idle_seconds))
    app.state.hub = hub
    app.add_middleware(_QuietDisconnect)
    app.add_middleware(_ObjectFrames)
    sessions = _Sessions(hub, max_sessions, idle_seconds)
    app.state.sessions = sessions
    # The original's /health replaces OpenEnv's.
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != "/health"]

    @app.exception_handler(ServeError)
    async def refused(request: Request, exc: ServeError):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    app.add_middleware(_LimitBody, limit=max_body_bytes)

    @app.get("/health")
    async def health():
        return {"status": "ok", "environment": "libratio_jax", "version": __version__,
                "active_sessions": hub.active_sessions, "fleet_sessions": len(sessions)}

    @app.get("/fleet/tasks")
    async def tasks():
        out = []
        for task_id, env_name in Hub.tasks().items():
            description, level = _DESCRIPTIONS.get(task_id, (env_name, "physics"))
            out.append({"id": task_id, "task_id": task_id, "env": env_name,
                        "description": description, "difficulty": level,
                        "max_steps": None})
        return out

    @app.post("/fleet/reset")
    async def fleet_reset(request: Request):
        body = await _json_body(request, max_body_bytes)
        if not isinstance(body, dict):
            raise ServeError("reset: the body must be a JSON object like "
                             '{"task_id": "fleet_precision"}')
        unknown = set(body) - {"task_id", "seed", "scenario_id"}
        if unknown:
            raise ServeError(f"reset: unknown fields {sorted(unknown)}; valid: task_id, seed "
                             "(scenario_id is accepted and ignored, as the original did)")
        hub.resolve(body.get("task_id"))  # refused requests take no session
        check_seed(body.get("seed"))
        sid = _session_id(request) or DEFAULT_SESSION
        new = sid not in sessions
        with sessions.using(sid, create=True) as env:
            try:
                obs = await env.reset_async(seed=body.get("seed"), task=body.get("task_id"))
            except Exception:
                if new:
                    sessions.drop(sid)
                raise
            sessions.history(sid).clear()
        response = JSONResponse({"observation": _observation(obs, env), "session_id": sid})
        response.set_cookie(COOKIE, sid)
        return response

    @app.post("/fleet/session")
    async def new_session():
        """A fresh session id (for clients that keep no cookies)."""
        sid = uuid.uuid4().hex
        response = JSONResponse({"session_id": sid})
        response.set_cookie(COOKIE, sid)
        return response

    @app.post("/fleet/step")
    async def fleet_step(request: Request):
        body = await _json_body(request, max_body_bytes)
        if not isinstance(body, dict):
            raise ServeError('step: the body must be a JSON object: {"action": {...}}')
        action = body.get("action", body)
        if not isinstance(action, dict):
            raise ServeError("step: the action must be a JSON object")
        if "reply" in action and not isinstance(action["reply"], str):
            raise ServeError("step: reply must be text")
        reply = action["reply"] if "reply" in action else json.dumps(action)
        if len(reply) > MAX_REPLY_CHARS:
            raise ServeError(f"step: the action is over {MAX_REPLY_CHARS} characters", 413)
        sid = _session_id(request) or DEFAULT_SESSION
        with sessions.using(sid, create=False) as env:
            obs = await env.step_async(LibratioAction(reply=reply))
            # (the reply alone: other keys of the body are not kept, so a session's history
            # holds at most MAX_REPLY_CHARS a step)
            sessions.history(sid).append({"action": {"reply": reply} if "reply" in action
                                          else action, "reward": obs.reward})
        return {"observation": None if obs.done else _observation(obs, env),
                "reward": {"score": obs.reward, "feedback": obs.text}, "done": obs.done,
                "info": {"stage": obs.stage, "reason": obs.reason, "rules": obs.rules}}

    @app.post("/fleet/state")
    async def fleet_state(request: Request):
        sid = _session_id(request) or DEFAULT_SESSION
        env = sessions.get(sid, create=False)
        st = env.state
        task_id = next((k for k, v in ORIGINAL_TASKS.items() if v == st.task), st.task)
        return {"task_id": task_id, "current_task": st.task,
                "current_scenario_id": st.seed, "step_number": st.step_count,
                "is_done": st.done, "history": sessions.history(sid)}

    async def reap_idle():
        while True:
            await asyncio.sleep(max(1.0, (idle_seconds or 60.0) / 4))
            try:
                sessions.evict_idle()
            except Exception:  # noqa: BLE001 - one failed pass must not stop the reaping
                logging.getLogger(__name__).exception("evicting idle sessions failed")

    inner = app.router.lifespan_context  # OpenEnv's (Starlette's default: its handlers)

    @contextlib.asynccontextmanager
    async def lifespan(app_):
        """Idle sessions reaped while the server runs; the hub closed when it stops, after
        OpenEnv's shutdown (which waits for its sessions' steps), also if startup failed."""
        try:
            async with inner(app_) as state:
                reaper = (None if idle_seconds is None
                          else asyncio.get_running_loop().create_task(reap_idle()))
                try:
                    yield state
                finally:
                    if reaper is not None:
                        reaper.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await reaper
        finally:
            hub.close()

    app.router.lifespan_context = lifespan
    return app


def _observation(obs: LibratioObservation, env: LibratioEnvironment) -> dict:
    return {"task_id": env.task, "text": obs.text, "turn": obs.turn, "done": obs.done,
            **({"system_prompt": obs.system_prompt} if obs.system_prompt else {})}


_DEFAULT_APP: FastAPI | None = None


def __getattr__(name: str):
    """``app``: the app built from environment variables, for ``uvicorn
    libratio_jax.serve.app:app`` and OpenEnv manifests: ``LIBRATIO_MAX_SESSIONS`` (256),
    ``LIBRATIO_WINDOW_MS`` (2; 0: no batching), ``LIBRATIO_IDLE_TIMEOUT`` (600 seconds)."""
    global _DEFAULT_APP
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _DEFAULT_APP is None:
        import os

        window_ms = float(os.environ.get("LIBRATIO_WINDOW_MS", "2"))
        _DEFAULT_APP = build_app(
            max_sessions=int(os.environ.get("LIBRATIO_MAX_SESSIONS", "256")),
            window_seconds=window_ms / 1e3 if window_ms > 0 else None,
            idle_seconds=float(os.environ.get("LIBRATIO_IDLE_TIMEOUT", "600")))
    return _DEFAULT_APP
