"""`libratio eval` against a real HTTP endpoint: a stub OpenAI-compatible server, started
here, answers with good actions, unreadable text, silence (timeouts) or HTTP 500."""

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("httpx")

from libratio_jax import cli  # noqa: E402
from libratio_jax.integrations import llm_eval as L  # noqa: E402
from libratio_jax.integrations.chat_client import ChatClient, ChatError  # noqa: E402


def good_reply(messages) -> str:
    """A readable, valid action for whichever task and phase the conversation is in."""
    system, last = messages[0]["content"], messages[-1]["content"]
    if "Recover it in three turns" in system:  # Fleet-Recovery
        if "Predict its memory" in last:
            return '{"memory_gib": 20, "tokens_per_second": 5000}'
        m = re.search(r"Write tenant (\d+)'s new plan", last)
        if m:
            return f'{{"tenants": [{{"id": {m.group(1)}, "gpus": 1}}]}}'
        return 'The loss went NaN. {"tenant": 0, "failure": "oom"}'
    if "crashed. In three turns" in system:  # classic recovery
        return ('{"diagnosed_model": "model_a", "root_cause": "fp16 attention overflow", '
                '"reasoning": "the loss became NaN", "new_precision_strategy": '
                '{"attention": "BF16"}}')
    if "precision_strategy" in system and "allocations" not in system:
        return '{"precision_strategy": {"embedding": "FP32", "ffn": "FP8"}}'
    if "allocations" in system:
        return '{"allocations": {"model_a": {"gpus": 1}}}'
    if "continue_monitoring" in system:
        return '{"action_type": "continue_monitoring"}'
    tenant = re.search(r"^  tenant (\d+): ", messages[1]["content"], re.M).group(1)
    return f'{{"tenants": [{{"id": {tenant}, "gpus": 1}}]}}'  # Fleet-*


class _Stub(BaseHTTPRequestHandler):
    calls: dict = {}

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        model = body["model"]
        _Stub.calls[model] = _Stub.calls.get(model, 0) + 1
        if model == "error":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"internal error")
            return
        if model == "slow":
            time.sleep(1.0)  # past the client's timeout: it has hung up (see below)
        text = good_reply(body["messages"]) if model in ("good", "slow") else (
            "I would rather not say.")
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}],
                          "usage": {"prompt_tokens": 7, "completion_tokens": 3}}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out and left


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_good_model_plays_every_task(endpoint, tmp_path):
    out = tmp_path / "eval.json"
    rc = cli.main(["eval", "--base-url", endpoint, "--model", "good", "--task", "all",
                   "--episodes", "1", "--seed", "3", "--bank-size", "2", "--no-baselines",
                   "--no-progress", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["tasks"]) == set(L.EVAL_TASKS)
    assert report["command"][:2] == ["libratio", "eval"] and report["versions"]["jax"]
    for task, t in report["tasks"].items():
        s, (ep,) = t["model"]["summary"], t["model"]["episodes"]
        assert ep["status"] == "ok" and s["failed"] == 0, (task, ep["error"])
        assert ep["turns"] >= 1 and s["scored"] == 1 and 0.0 <= s["mean_score"] <= 0.99
        assert s["valid_action_rate"] == 1.0, (task, [x["reason"] for x in ep["transcript"]])
        assert ep["prompt_tokens"] == 7 * ep["turns"]
        first = ep["transcript"][0]
        assert first["parsed"] is not None and isinstance(first["feedback"], str)
        assert ep["score"] == pytest.approx(
            sum(x["reward"] for x in ep["transcript"]) / ep["turns"])
    assert "| fleet_recovery | good | model |" in (tmp_path / "eval.md").read_text()


def test_failures_are_recorded_not_scored(endpoint):
    report = L.run_eval(tasks="classic_precision", episodes=2, seed=0, base_url=endpoint,
                        model="malformed", baselines=False, progress=False, log=lambda m: None)
    s = report["tasks"]["classic_precision"]["model"]["summary"]
    assert s["failed"] == 0 and s["scored"] == 2 and s["valid_action_rate"] == 0.0
    assert s["mean_score"] == pytest.approx(0.01)  # unreadable replies: judged, floored
    for model, kind in (("error", "http_500"), ("slow", "timeout")):
        report = L.run_eval(tasks="classic_precision", episodes=2, seed=0, base_url=endpoint,
                            model=model, timeout_seconds=0.2, max_retries=1,
                            backoff_seconds=0.01, baselines=False, progress=False,
                            log=lambda m: None)
        t = report["tasks"]["classic_precision"]["model"]
        assert t["summary"]["failed"] == 2 and t["summary"]["mean_score"] is None
        for ep in t["episodes"]:
            assert ep["status"] == "endpoint_error" and kind in ep["error"]
            assert "2 attempts" in ep["error"] and ep["score"] is None
    assert _Stub.calls["error"] == 4  # two episodes, each tried twice


def test_baselines_on_the_same_seeds_and_errors():
    report = L.run_eval(tasks="classic_precision", episodes=3, seed=1, base_url=None,
                        model=None, progress=False, log=lambda m: None)
    t = report["tasks"]["classic_precision"]["baselines"]
    assert set(t) == {"random", "ideal table", "exhaustive"}
    assert [e["seed"] for e in t["random"]["episodes"]] == [1, 2, 3]
    score = {k: v["summary"]["mean_score"] for k, v in t.items()}
    # the exhaustive search plays each turn's best strategy: never below the ideal table
    assert score["exhaustive"] >= score["ideal table"] - 1e-6 > score["random"]
    for mine, table in zip(t["exhaustive"]["episodes"], t["ideal table"]["episodes"],
                           strict=True):
        assert mine["score"] >= table["score"] - 1e-6
    assert "| classic_precision | ideal table | scripted |" in report["table"]
    # the same seeds play the same episodes: a second run gives the same scores
    again = L.run_eval(tasks="classic_precision", episodes=3, seed=1, base_url=None,
                       model=None, progress=False, log=lambda m: None)
    assert again["tasks"]["classic_precision"]["baselines"]["ideal table"]["summary"] == \
        t["ideal table"]["summary"]
    # seeds wrap within 64-bit integers, as a pool's sessions' do: the records name them
    top = L.play_baseline("Classic-FleetPrecision-v0", L.Baseline("random", "random",
                                                                 act=L._space_sample),
                          2, 2**63 - 1, max_turns=1)
    assert [e["seed"] for e in top] == [2**63 - 1, -(2**63)]
    with pytest.raises(ValueError, match="unknown task"):
        L.resolve_tasks("chess")
    with pytest.raises(ValueError, match="go together"):
        L.run_eval(base_url="http://x", model=None)
    with pytest.raises(SystemExit):
        cli.main(["eval", "--task", "chess", "--no-progress"])


def test_client_errors_name_the_problem(endpoint):
    import asyncio

    async def call(model, **kw):
        async with ChatClient(endpoint, model, max_retries=0, **kw) as c:
            return await c.chat([{"role": "system", "content": "Plan."},
                                 {"role": "user", "content": "  tenant 0: a model"}])

    reply = asyncio.run(call("good"))
    assert reply.text and reply.prompt_tokens == 7 and reply.attempts == 1
    with pytest.raises(ChatError, match="http_500"):
        asyncio.run(call("error"))
    with pytest.raises(ValueError, match="base_url"):
        ChatClient("localhost:8000", "m")
