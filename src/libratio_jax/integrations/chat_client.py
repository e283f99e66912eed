"""An asynchronous client for OpenAI-compatible chat endpoints (vLLM, TGI, llama.cpp server,
hosted APIs): ``POST {base_url}/chat/completions``, with a per-request timeout and retries with
exponential backoff on what is worth retrying (transport errors, timeouts, HTTP 429 and 5xx).

Needs ``httpx`` (the ``eval`` extra: ``pip install -e ".[eval]"``).

    >>> client = ChatClient("http://localhost:8000/v1", "my-model")  # doctest: +SKIP
    >>> reply = await client.chat([{"role": "user", "content": "Hi"}])  # doctest: +SKIP
    >>> reply.text, reply.completion_tokens  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Sequence
from typing import Any

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


class ChatError(Exception):
    """The endpoint gave no reply (after the retries): ``kind`` is ``timeout``,
    ``transport``, ``http_<status>`` or ``bad_response``; ``attempts`` the requests made."""

    def __init__(self, kind: str, message: str, attempts: int):
        super().__init__(f"{kind}: {message} (after {attempts} attempt"
                         f"{'s' if attempts != 1 else ''})")
        self.kind = kind
        self.attempts = attempts


@dataclasses.dataclass(frozen=True)
class ChatReply:
    """One completion: its ``text`` ("" when the model returned no content), the token counts
    the endpoint reported (0 when it reports none), the requests it took."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: int = 1


class ChatClient:
    """Chat completions from ``base_url`` (e.g. ``http://localhost:8000/v1``) for ``model``.

    ``api_key``: sent as a bearer token when given. ``timeout_seconds``: per request.
    ``max_retries``: extra attempts after a retryable failure, waiting ``backoff_seconds *
    2**k`` (with up to 25% jitter) before attempt ``k + 1``. Use as an async context manager,
    or call :meth:`aclose`."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 temperature: float = 0.0, max_tokens: int = 1024,
                 timeout_seconds: float = 60.0, max_retries: int = 3,
                 backoff_seconds: float = 1.0, seed: int | None = None):
        import httpx

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if max_retries < 0 or timeout_seconds <= 0 or max_tokens < 1:
            raise ValueError("max_retries must be >= 0, timeout_seconds > 0, max_tokens >= 1")
        self.model = model
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.max_retries = int(max_retries)
        self.backoff_seconds = float(backoff_seconds)
        self.seed = seed
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                                       timeout=httpx.Timeout(timeout_seconds))
        self._httpx = httpx
        self._jitter = random.Random(0 if seed is None else seed)

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _body(self, messages: Sequence[dict]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": list(messages),
                                "temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.seed is not None:
            body["seed"] = self.seed
        return body

    async def chat(self, messages: Sequence[dict]) -> ChatReply:
        """The assistant's reply to ``messages``; :class:`ChatError` when none came."""
        httpx = self._httpx
        last = ("transport", "no attempt made")
        for attempt in range(1, self.max_retries + 2):
            try:
                r = await self._http.post("/chat/completions", json=self._body(messages))
            except httpx.TimeoutException as e:
                last = ("timeout", f"no answer within the timeout ({type(e).__name__})")
            except httpx.HTTPError as e:
                last = ("transport", f"{type(e).__name__}: {e}")
            else:
                if r.status_code == 200:
                    return _reply(r, attempt)
                last = (f"http_{r.status_code}", r.text[:200])
                if r.status_code not in RETRY_STATUS:
                    raise ChatError(*last, attempt)
            if attempt <= self.max_retries:
                wait = self.backoff_seconds * 2 ** (attempt - 1)
                await asyncio.sleep(wait * (1.0 + 0.25 * self._jitter.random()))
        raise ChatError(*last, self.max_retries + 1)


def _reply(response, attempts: int) -> ChatReply:
    try:
        data = response.json()
        message = data["choices"][0]["message"]
        content = message.get("content") or ""
        usage = data.get("usage") or {}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ChatError("bad_response", f"not a chat completion ({type(e).__name__}): "
                        f"{response.text[:200]}", attempts) from None
    if not isinstance(content, str):
        raise ChatError("bad_response", "message content is not text", attempts)

    def count(key: str) -> int:
        v = usage.get(key, 0) if isinstance(usage, dict) else 0
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0

    return ChatReply(content, count("prompt_tokens"), count("completion_tokens"), attempts)
