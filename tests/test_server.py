"""`libratio serve` with real parts: server processes (uvicorn) started here, driven by plain
httpx calls (the original service's routes), cookie-keeping httpx clients, and OpenEnv
WebSocket clients."""

import asyncio
import contextlib

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openenv")

from libratio_jax.serve.process import local_server  # noqa: E402
from libratio_jax.text.session import TextSession  # noqa: E402

PRECISION = "Classic-FleetPrecision-v0"
TIMEOUT = 120.0  # the first request of a task waits for its pool's compile


def LibratioClient(*args, **kw):  # noqa: N802 - the client class, imported on first use
    # (openenv-core imports gradio, seconds at collection for every test worker)
    from libratio_jax.serve.client import LibratioClient as cls
    return cls(*args, **kw)


def ClientPool(*args, **kw):  # noqa: N802
    from libratio_jax.serve.client import ClientPool as cls
    return cls(*args, **kw)


def post(url, **kw):
    return httpx.post(url, timeout=TIMEOUT, **kw)


def get(url, **kw):
    return httpx.get(url, timeout=TIMEOUT, **kw)


def _server(*args: str, **kw):
    return local_server("--bank-size", "2", *args, **kw)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server process and the file its stderr goes to."""
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with open(log, "w+b") as f, _server("--max-sessions", "80", stderr=f) as url:
        yield url, log


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _local_rewards(env: str, seed: int, replies) -> list[float]:
    s = TextSession(env, seed=seed, **({} if env.startswith("Classic-") else {"bank_size": 2}))
    s.reset(seed)
    out = []
    for reply in replies:
        r = s.step(reply)
        out.append(r.reward)
        if r.done:
            break
    return out


# replies a client of the original service sends (its JSON actions)
_ORIGINAL_EPISODES = {
    "fleet_precision": [{"precision_strategy": {"embedding": "FP32", "ffn": "FP8",
                                                "attention": "BF16"}}] * 8,
    "fleet_resource": [{"allocations": {"model_a": {"gpus": 2}}}] * 8,
    "fleet_oversight": [{"action_type": "continue_monitoring"}] * 8,
    "fleet_recovery": [{"diagnosed_model": "model_b", "root_cause": "fp8 embedding underflow",
                        "reasoning": "loss went NaN", "new_precision_strategy":
                        {"embedding": "FP32"}}] * 4,
}


def test_original_routes_play_every_task_with_plain_httpx(server):
    """A script written against the original service (one-off httpx.post calls, no cookies)
    plays full episodes; scores equal the same episodes played locally."""
    import json

    assert get(server + "/health").json()["status"] == "ok"
    ids = {t["task_id"] for t in get(server + "/fleet/tasks").json()}
    assert set(_ORIGINAL_EPISODES) <= ids and {"Fleet-Recovery-v0", "RLCluster-v0"} <= ids
    for task, actions in _ORIGINAL_EPISODES.items():
        r = post(server + "/fleet/reset", json={"task_id": task, "seed": 5})
        assert r.status_code == 200 and r.json()["observation"]["text"]
        scores = []
        for action in actions:
            out = post(server + "/fleet/step", json={"action": action}).json()
            scores.append(out["reward"]["score"])
            assert isinstance(out["reward"]["feedback"], str)
            if out["done"]:
                assert out["observation"] is None
                break
        env = post(server + "/fleet/state").json()
        assert env["task_id"] == task and env["is_done"] and env["step_number"] == len(scores)
        if task in ("fleet_precision", "fleet_oversight"):  # (the others: as the classic tests)
            expected = _local_rewards(env["current_task"], 5, [json.dumps(a) for a in actions])
            assert scores == pytest.approx(expected, abs=1e-6), task
    # text replies go through the same routes (any task takes {"reply": text})
    post(server + "/fleet/reset", json={"task_id": "fleet_oversight", "seed": 2})
    out = post(server + "/fleet/step", json={"reply": 'Fine. {"action_type": '
                                                     '"continue_monitoring"}'})
    assert out.status_code == 200 and out.json()["info"]["stage"] == "valid"


def test_cookie_sessions_never_see_each_other(server):
    a, b = (httpx.Client(base_url=server, timeout=TIMEOUT) for _ in range(2))
    with a, b:
        a.post("/fleet/session")
        b.post("/fleet/session")
        assert a.cookies.get("libratio_session") != b.cookies.get("libratio_session")
        a.post("/fleet/reset", json={"task_id": "fleet_precision", "seed": 1})
        b.post("/fleet/reset", json={"task_id": "fleet_precision", "seed": 2})
        ra, rb = [], []
        for _ in range(3):  # interleaved
            ra.append(a.post("/fleet/step", json={"precision_strategy": {"ffn": "FP8",
                                                                         "embedding": "FP32"}})
                      .json()["reward"]["score"])
            rb.append(b.post("/fleet/step", json={"precision_strategy": {"ffn": "BF16"}})
                      .json()["reward"]["score"])
        assert a.post("/fleet/state").json()["current_scenario_id"] == 1
        assert b.post("/fleet/state").json()["current_scenario_id"] == 2
    assert ra == pytest.approx(_local_rewards(
        PRECISION, 1, ['{"precision_strategy": {"ffn": "FP8", "embedding": "FP32"}}'] * 3))
    assert rb == pytest.approx(_local_rewards(
        PRECISION, 2, ['{"precision_strategy": {"ffn": "BF16"}}'] * 3))


def test_bad_input_is_a_4xx_that_names_the_problem(server):
    h = {"X-Session-Id": "bad-input"}
    cases = [
        (post(server + "/fleet/reset", content=b"{not json", headers=h), 400, "JSON"),
        (post(server + "/fleet/reset", json={"task_id": "chess"}, headers=h), 400,
         "unknown task"),
        (post(server + "/fleet/reset", json={"task_id": "fleet_precision",
                                                   "seed": "x"}, headers=h), 400, "seed"),
        (post(server + "/fleet/reset", json=[1, 2], headers=h), 400, "JSON object"),
        (post(server + "/fleet/step", json={"action": {}},
                    headers={"X-Session-Id": "never-reset"}), 404, "unknown session"),
        (post(server + "/fleet/state", headers={"X-Session-Id": "nope"}), 404,
         "unknown session"),
        (post(server + "/fleet/step", content=b"x" * (2 << 20), headers=h), 413,
         "bytes"),
    ]
    cases += [
        (post(server + "/fleet/reset", json={"task_id": "fleet_oversight", "seed": 2**64},
              headers=h), 400, "seed"),
        (post(server + "/fleet/step", json={"reply": 5}, headers={"X-Session-Id": "x"}), 400,
         "reply must be text"),
    ]
    before = get(server + "/health").json()["fleet_sessions"]
    for r, status, words in cases:
        assert r.status_code == status and words in r.json()["detail"], (r.status_code, r.text)
    assert get(server + "/health").json()["fleet_sessions"] == before  # refusals take none
    post(server + "/fleet/reset", json={"task_id": "fleet_recovery", "seed": 0},
               headers=h)
    r = post(server + "/fleet/step", json={"action": {"reasoning": "x" * 300_000}}, headers=h)
    assert r.status_code == 413 and "characters" in r.json()["detail"]
    r = post(server + "/fleet/step", json={"action": "flag"}, headers=h)
    assert r.status_code == 400 and "JSON object" in r.json()["detail"]
    for _ in range(3):  # wrong-typed fields are judged as unreadable replies, not errors
        r = post(server + "/fleet/step", json={"action": {"reasoning": 5}}, headers=h)
        assert r.status_code == 200
    r = post(server + "/fleet/step", json={"action": {}}, headers=h)
    assert r.status_code == 409 and "finished" in r.json()["detail"]
    # OpenEnv's stateless HTTP step has no episode: refused, not a 500
    r = post(server + "/step", json={"action": {"reply": "x"}})
    assert r.status_code == 409 and "reset" in r.json()["detail"]
    assert get(server + "/health").status_code == 200


async def _ws_episode(url, seed, replies):
    async with LibratioClient(url) as c:
        await c.reset(task=PRECISION, seed=seed)
        out = []
        for reply in replies:
            r = await c.step(reply)
            out.append(r.reward)
            await asyncio.sleep(0)  # interleave with the other sessions
            if r.done:
                break
        return out


def test_64_websocket_sessions_each_see_only_their_episode(served):
    server, log = served
    replies = [f'{{"precision_strategy": {{"ffn": "{f}", "embedding": "FP32"}}}}'
               for f in ("FP8", "BF16", "FP16", "FP32")]

    async def main():
        return await asyncio.gather(*(
            _ws_episode(server, 100 + i, [replies[(i + k) % 4] for k in range(8)])
            for i in range(64)))

    got = asyncio.run(main())
    for i in (0, 1, 2, 3, 17, 63):
        assert got[i] == pytest.approx(_local_rewards(
            PRECISION, 100 + i, [replies[(i + k) % 4] for k in range(8)]), abs=1e-6)
    health = get(server + "/health").json()  # the WebSocket sessions freed their slots
    assert health["active_sessions"] == health["fleet_sessions"]
    # a client closing its session normally is not a server error (nothing in the log)
    assert "Traceback" not in log.read_text(errors="replace")


def test_errors_and_disconnects_over_websocket(server):
    async def main():
        c = LibratioClient(server)
        await c.connect()
        with pytest.raises(RuntimeError, match="step before reset"):
            await c.step("x")
        with pytest.raises(RuntimeError, match="unknown task"):
            await c.reset(task="chess")
        await c.reset(task=PRECISION, seed=0)
        before = get(server + "/health").json()["active_sessions"]
        await c._ws.close()  # drop the connection mid-episode, no close message
        for _ in range(50):
            if get(server + "/health").json()["active_sessions"] < before:
                return True
            await asyncio.sleep(0.1)
        return False

    assert asyncio.run(main())


def test_pool_routes_to_the_least_loaded_replica_and_bursts_are_refused(server):
    with _server("--max-sessions", "3") as a:
        b = server  # a second replica (with room for more)
        pool = ClientPool([a, b])

        async def main():
            async with contextlib.AsyncExitStack() as stack:
                opened = [await stack.enter_async_context(pool.episode(task=PRECISION,
                                                                        seed=i))
                          for i in range(4)]
                assert pool.active == {0: 2, 1: 2}
                r = await opened[0][0].step('{"precision_strategy": {"ffn": "FP8"}}')
                assert r.reward is not None
            assert pool.active == {0: 0, 1: 0}
            # a burst past --max-sessions: the extra sessions are refused cleanly
            clients = [LibratioClient(a) for _ in range(5)]
            results = await asyncio.gather(*(c.reset(task=PRECISION) for c in clients),
                                           return_exceptions=True)
            refused = [r for r in results if isinstance(r, Exception)]
            for c in clients:
                with contextlib.suppress(Exception):
                    await c.close()
            return len(refused)

        assert asyncio.run(main()) == 2
        assert get(a + "/health").status_code == 200


def test_eval_plays_on_the_server_as_locally(server):
    """`libratio eval --env-url`: the model's episodes on the server score as local ones."""
    import threading
    from http.server import ThreadingHTTPServer

    from test_llm_eval import _Stub

    from libratio_jax.integrations import llm_eval as L

    stub = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{stub.server_address[1]}/v1"
    try:
        kw = dict(tasks="classic_precision", episodes=2, seed=4, base_url=endpoint,
                  model="good", baselines=False, progress=False, log=lambda m: None)
        remote = L.run_eval(env_url=server, **kw)["tasks"]["classic_precision"]["model"]
        local = L.run_eval(**kw)["tasks"]["classic_precision"]["model"]
    finally:
        stub.shutdown()
    assert remote["summary"]["failed"] == 0
    assert [e["score"] for e in remote["episodes"]] == pytest.approx(
        [e["score"] for e in local["episodes"]], abs=1e-6)
    assert remote["episodes"][0]["transcript"][0]["feedback"] == \
        local["episodes"][0]["transcript"][0]["feedback"]
    # a server that is not there: every episode recorded as failed, none scored
    down = L.run_eval(env_url="http://127.0.0.1:9", **{**kw, "episodes": 1})
    s = down["tasks"]["classic_precision"]["model"]
    assert s["summary"]["failed"] == 1 and s["episodes"][0]["status"] == "env_error"


@pytest.mark.parametrize("window", [0.002, None])
def test_first_sessions_arriving_together_share_one_pool(window):
    """(In-process.) Sessions that start at once, batched or not, play their own episodes:
    their task's pool is built once, not once per racing request."""
    from libratio_jax.serve.batcher import Hub
    from libratio_jax.serve.environment import LibratioEnvironment
    from libratio_jax.serve.models import LibratioAction

    reply = '{"precision_strategy": {"embedding": "FP32", "ffn": "FP8"}}'

    async def main():
        hub = Hub(8, window_seconds=window)

        async def episode(seed):
            env = LibratioEnvironment(hub)
            await env.reset_async(seed=seed, task=PRECISION)
            out = []
            while not env.state.done:
                out.append((await env.step_async(LibratioAction(reply=reply))).reward)
            env.close()
            return out

        return await asyncio.gather(*(episode(s) for s in (4, 5, 6))), hub

    got, hub = asyncio.run(main())
    assert got == [pytest.approx(_local_rewards(PRECISION, s, [reply] * 8)) for s in (4, 5, 6)]
    assert hub.active_sessions == 0
    hub.close()


def test_concurrent_steps_of_one_session_are_played_in_turn(server):
    """Four steps sent at once on one session are four turns, not one judged four times."""
    h = {"X-Session-Id": "eager"}
    post(server + "/fleet/reset", json={"task_id": "fleet_resource", "seed": 0}, headers=h)

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(
                c.post("/fleet/step", json={"allocations": {"model_a": {"gpus": 1}}},
                       headers=h) for _ in range(4)))

    turns = sorted(r.json()["observation"]["turn"] for r in asyncio.run(main()))
    assert turns == [1, 2, 3, 4]
    assert post(server + "/fleet/state", headers=h).json()["step_number"] == 4


def test_module_app_for_uvicorn_and_manifests(monkeypatch):
    """``uvicorn libratio_jax.serve.app:app`` (and openenv.yaml) find a configured app."""
    from libratio_jax.serve import app as A

    monkeypatch.setattr(A, "_DEFAULT_APP", None)
    monkeypatch.setenv("LIBRATIO_MAX_SESSIONS", "5")
    app = A.app
    assert app is A.app and app.state.hub.capacity == 5
    assert {"/health", "/fleet/reset", "/ws"} <= {getattr(r, "path", None) for r in app.routes}
    with pytest.raises(AttributeError):
        A.nothing_here  # noqa: B018


def test_a_session_in_use_is_not_idle(monkeypatch):
    """A /fleet session is idle from the end of its last request: not evicted while a
    request runs past the idle timeout (a first reset compiles for seconds), nor right after
    it; evicted once idle that long since."""
    from libratio_jax.serve import app as A
    from libratio_jax.serve.batcher import Hub

    now = [100.0]
    monkeypatch.setattr(A.time, "monotonic", lambda: now[0])
    sessions = A._Sessions(Hub(2), limit=2, idle_seconds=1.0)
    with sessions.using("a", create=True):
        with sessions.using("a", create=False):  # two requests of one session at once
            now[0] += 5.0
            sessions.evict_idle()
            assert "a" in sessions
        now[0] += 5.0
        sessions.evict_idle()
        assert "a" in sessions  # the first request still runs
    sessions.evict_idle()
    assert "a" in sessions  # idle from the request's end, not its start
    now[0] += 1.5
    sessions.evict_idle()
    assert "a" not in sessions and len(sessions) == 0
    with pytest.raises(A.ServeError, match="unknown session"):
        with sessions.using("a", create=False):
            pass


def test_idle_sessions_are_reaped_without_requests():
    """The server's lifespan runs the reaper: a /fleet session left idle past
    ``--idle-timeout`` is closed although no request comes to look it up."""
    import time

    with _server("--idle-timeout", "1") as url:
        h = {"X-Session-Id": "idle"}
        post(url + "/fleet/reset", json={"task_id": "fleet_precision", "seed": 0}, headers=h)
        assert get(url + "/health").json()["fleet_sessions"] == 1
        deadline = time.monotonic() + 30.0
        while get(url + "/health").json()["fleet_sessions"] and time.monotonic() < deadline:
            time.sleep(0.25)
        assert get(url + "/health").json()["fleet_sessions"] == 0
        assert post(url + "/fleet/state", headers=h).status_code == 404


def test_bodies_without_a_length_are_read_only_up_to_the_limit(server):
    """A chunked body (no Content-Length) over the limit is not read whole: 413 on the
    ``/fleet`` routes, a short 4xx on OpenEnv's (one answered a 422 repeating a 40 MB body);
    the server goes on."""
    def body():
        yield b'{"action": {"reply": "'
        for _ in range(48):
            yield b"x" * (64 << 10)  # 3 MB in all
        yield b'"}, "seed": "x"}'  # (valid JSON, not a valid request)

    r = post(server + "/fleet/step", content=body(), headers={"X-Session-Id": "chunked"})
    assert r.status_code == 413 and "bytes" in r.json()["detail"]
    for path in ("/step", "/reset"):
        r = post(server + path, content=body(), headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500 and len(r.content) < 1000, (path, r.status_code)
    assert get(server + "/health").status_code == 200


def test_a_sessions_history_keeps_its_replies_alone(server):
    """``/fleet/state``'s history holds each step's reply, not the rest of its body (a
    session's memory stays bounded by the reply's limit)."""
    h = {"X-Session-Id": "history"}
    post(server + "/fleet/reset", json={"task_id": "fleet_oversight", "seed": 0}, headers=h)
    reply = '{"action_type": "continue_monitoring"}'
    r = post(server + "/fleet/step", json={"reply": reply, "junk": [{}] * 20_000}, headers=h)
    assert r.status_code == 200
    history = post(server + "/fleet/state", headers=h).json()["history"]
    assert history == [{"action": {"reply": reply}, "reward": r.json()["reward"]["score"]}]


def test_a_refused_reset_keeps_the_running_episode():
    """A reset to a task whose slots are all taken is refused (503) without ending the
    session's running episode, which its next step continues."""
    from websockets.sync.client import connect

    with _server("--max-sessions", "1") as url:
        h = {"X-Session-Id": "s"}
        assert post(url + "/fleet/reset", json={"task_id": "fleet_precision", "seed": 0},
                    headers=h).status_code == 200
        with connect(url.replace("http", "ws", 1) + "/ws") as ws:  # the task's only slot
            ws.send('{"type": "reset", "data": {"task": "fleet_resource", "seed": 0}}')
            assert '"observation"' in ws.recv(timeout=TIMEOUT)
            r = post(url + "/fleet/reset", json={"task_id": "fleet_resource"}, headers=h)
            assert r.status_code == 503 and "slots" in r.json()["detail"]
            r = post(url + "/fleet/step", json={"precision_strategy": {"ffn": "BF16"}},
                     headers=h)
            assert r.status_code == 200 and r.json()["reward"]["feedback"].startswith("Turn 1")


def test_malformed_websocket_frames_are_answered_and_the_session_goes_on(server):
    """Frames openenv-core's ``/ws`` loop cannot read (a binary frame; JSON that is not an
    object, which its ``message.get`` raised on) are answered with an error frame, and the
    session's episode goes on: before, either ended the session."""
    import json

    from websockets.sync.client import connect

    with connect(server.replace("http", "ws", 1) + "/ws") as ws:
        ws.send(json.dumps({"type": "reset", "data": {"task": PRECISION, "seed": 0}}))
        first = json.loads(ws.recv(timeout=TIMEOUT))
        assert first["type"] == "observation"
        deep = '{"type": "state", "x": ' + "[" * 3000 + "]" * 3000 + "}"  # (RecursionError)
        for bad in ("[1, 2]", "7", '"reset"', "null", b"\x00\x01", "  [", "{not json", deep,
                    '{"type": "state", "x": ' + "[" * 64 + "]" * 64 + "}"):
            ws.send(bad)
            got = json.loads(ws.recv(timeout=TIMEOUT))
            assert got["type"] == "error" and got["data"]["message"], (bad, got)
        ws.send(json.dumps({"type": "state"}))
        state = json.loads(ws.recv(timeout=TIMEOUT))
        assert state["type"] == "state" and state["data"]["step_count"] == 0
        ws.send(json.dumps({"type": "step", "data": {"reply": "x"}}))
        assert json.loads(ws.recv(timeout=TIMEOUT))["type"] == "observation"


def test_the_frame_filter_finds_its_route_under_a_root_path():
    """``_ObjectFrames`` on an app served under a root path (``uvicorn --root-path``, a
    mount): ``/p/ws`` is its ``/ws``, and another route's frames pass untouched."""
    from libratio_jax.serve.app import MAX_FRAME_DEPTH, _ObjectFrames

    frames = [{"type": "websocket.connect"}, {"type": "websocket.receive", "text": "[1]"},
              {"type": "websocket.receive", "bytes": b"x"},
              {"type": "websocket.receive", "text": '{"type": "state"}'},
              {"type": "websocket.disconnect", "code": 1000}]

    def run(path, root_path=""):
        got, sent = [], []
        pending = iter(frames)

        async def receive():
            return next(pending)

        async def send(message):
            sent.append(message)

        async def app(scope, receive, send):
            for _ in range(3):
                got.append(await receive())

        scope = {"type": "websocket", "path": path, "root_path": root_path}
        asyncio.run(_ObjectFrames(app)(scope, receive, send))
        return [m["type"] if m["type"] != "websocket.receive" else m.get("text", m.get("bytes"))
                for m in got], len(sent)

    filtered = (["websocket.connect", '{"type": "state"}', "websocket.disconnect"], 2)
    assert run("/ws") == filtered
    assert run("/p/ws", root_path="/p") == filtered
    assert run("/mcp") == (["websocket.connect", "[1]", b"x"], 0)  # (another route's)
    assert MAX_FRAME_DEPTH >= 8  # (room for any action)
