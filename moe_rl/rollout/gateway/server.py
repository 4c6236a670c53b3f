"""The OpenAI-compatible endpoint over a run's engine: `POST /v1/chat/completions`, `GET /v1/models`.

    gw = Gateway(sampler, tokenizer, template, budget=Budget(3, 40, 128), sampling=(1.0, 1.0))
    gw.start()                                   # uvicorn on 127.0.0.1, a free port, own thread
    keys = gw.open([((0, 0), seed), ...])        # one api key per episode
    openai.AsyncOpenAI(base_url=gw.url, api_key=keys[(0, 0)], max_retries=0)
    ...
    gw.close_episode(keys[(0, 0)]); gw.stop()

The server runs in its own thread with its own event loop (a blocking agent cannot stall it);
the engine is called from the batcher's worker thread (`batcher`). Each request belongs to
the episode its api key names (`Authorization: Bearer <key>`); its token trajectory is kept
by `trajectory.AgentEpisode`. Responses are the standard chat-completion shape: the assistant
message, its `tool_calls` parsed by the model's own parser (`moe_rl.tokenization.tool_calls`,
arguments as a JSON string, ids `call_<group>_<response>_<call>_<i>`), the finish reason
(`tool_calls`, `stop`, `length`) and `usage` (prompt tokens fed, completion tokens sampled).

RefusedError in a run, with HTTP 400 and one line (what the learner could not score the same way):
a `temperature` or `top_p` other than the run's, `n` other than 1, `tool_choice` other than
`auto` or `none`, `max_tokens` (or `max_completion_tokens`) beyond rl.max_turn_tokens,
`stream`. An unknown key is 401; a second call of an episode while one is in flight, or a
call after its episode ended, is 409. Without a run (`serve=True`, `python -m moe_rl.serve`)
no key is needed, and any `n`, `temperature`, `top_p`, `max_tokens` and `seed` are honoured.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from moe_rl.rollout.gateway.batcher import WINDOW_S, EngineBatcher
from moe_rl.rollout.gateway.trajectory import AgentEpisode, Budget, Feed, normal
from moe_rl.tokenization.tool_calls import tool_call_parser
from moe_rl.tokenization.turns import ChatTurns


class RefusedError(Exception):
    """A request answered with an HTTP error and one line."""

    def __init__(self, status: int, line: str) -> None:
        super().__init__(line)
        self.status, self.line = status, line


def refusal(body: dict[str, Any], budget: Budget, sampling: tuple[float, float]) -> str | None:
    """Why a run's gateway cannot serve `body` as the learner will score it (None: it can)."""
    T, top_p = sampling
    if body.get("stream"):
        return "stream=true: the gateway answers whole responses; omit stream"
    if body.get("n", 1) != 1:
        return f"n={body.get('n')}: an episode is one sequence of calls; call once per sample (n=1)"
    if body.get("temperature") is not None and float(body["temperature"]) != T:
        return f"temperature={body['temperature']}: this run samples at {T} (sampler.temperature); omit it or pass {T}"
    if body.get("top_p") is not None and float(body["top_p"]) != top_p:
        return f"top_p={body['top_p']}: this run samples at {top_p} (sampler.top_p); omit it or pass {top_p}"
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        return f"tool_choice={choice!r}: the policy decides whether to call a tool; use auto or none"
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    if asked is not None and int(asked) > budget.turn_tokens:
        return f"max_tokens={asked}: a call may take at most {budget.turn_tokens} tokens (rl.max_turn_tokens)"
    return None


class Gateway:
    """The endpoint, its episodes and its engine batcher."""

    def __init__(self, sampler: Any, tokenizer: Any, template: str, *, budget: Budget,
                 sampling: tuple[float, float] = (1.0, 1.0), tool_parser: str = "auto", serve: bool = False,
                 model_name: str = "moe_rl", window_s: float = WINDOW_S, port: int = 0) -> None:
        self.tokenizer, self.template, self.budget, self.sampling = tokenizer, template, budget, sampling
        self.parse = tool_call_parser(tool_parser, template)
        self.serve, self.model_name, self.port = serve, model_name, port
        self.batcher = EngineBatcher(sampler, *sampling, None if serve else budget.turn_tokens, window_s)
        if serve:
            self.batcher.expect(1 << 30)  # (no episodes to wait for: each batch waits its window)
        self.episodes: dict[str, AgentEpisode] = {}
        self._turns: dict[str, ChatTurns] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ episodes

    def turns_for(self, tools: Sequence[dict[str, Any]] | None) -> ChatTurns:
        """The chat template showing `tools` (one per distinct tool list)."""
        import json

        key = json.dumps(tools or [], sort_keys=True)
        if key not in self._turns:
            self._turns[key] = ChatTurns(self.tokenizer, self.template, list(tools or []))
        return self._turns[key]

    def _episode(self, key: tuple[int, int], seed: int, budget: Budget | None = None) -> AgentEpisode:
        return AgentEpisode(key, seed, budget or self.budget, self.turns_for, self.parse, self.tokenizer.decode)

    def open(self, episodes: Sequence[tuple[tuple[int, int], int]]) -> dict[tuple[int, int], str]:
        """Open episodes ((group, response), base seed of the group); returns their api keys."""
        keys = {}
        for key, seed in episodes:
            api_key = f"ep-{key[0]}-{key[1]}-{secrets.token_hex(8)}"
            self.episodes[api_key] = self._episode(key, seed)
            keys[key] = api_key
        self._expect()
        return keys

    def close_episode(self, api_key: str) -> AgentEpisode:
        """The episode is over: its later calls are refused (409), its waiting request dropped."""
        ep = self.episodes[api_key]
        ep.closed = True
        self.batcher.drop(ep.key)
        self._expect()
        return ep

    def _expect(self) -> None:
        if not self.serve:
            self.batcher.expect(sum(not e.closed for e in self.episodes.values()))

    # ------------------------------------------------------------------ requests

    async def complete(self, body: dict[str, Any], api_key: str | None) -> dict[str, Any]:
        """One chat completion (raises `RefusedError`)."""
        if self.serve:
            return await self._serve(body)
        ep = self.episodes.get(api_key or "")
        if ep is None:
            raise RefusedError(401, "unknown api key: use the client the run handed the agent (its key names the episode)")
        if (why := refusal(body, self.budget, self.sampling)) is not None:
            raise RefusedError(400, why)
        if ep.closed:
            raise RefusedError(409, f"episode {ep.key} is over (its agent returned, timed out or raised)")
        if ep.busy:
            raise RefusedError(409, f"episode {ep.key} has a call in flight: calls of one episode are sequential")
        ep.busy = True
        try:
            return await self._turn(ep, body)
        finally:
            ep.busy = False

    async def _turn(self, ep: AgentEpisode, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RefusedError(400, "messages: a non-empty list of chat messages is required")
        feed = ep.begin(messages, body.get("tools") or None)
        if feed is None:  # (the episode's limits are used up: nothing sampled)
            return self._response([({"role": "assistant", "content": ""}, "length", 0)], 0)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None:
            feed = type(feed)(feed.ids, min(feed.room, int(asked)), feed.seed)
        tokens, logprobs, finish, routed = await asyncio.wrap_future(self.batcher.submit(ep.key, feed))
        if ep.closed:
            raise RefusedError(409, f"episode {ep.key} is over (its agent returned, timed out or raised)")
        message, reason = ep.record(feed, tokens, logprobs, finish, routed)
        return self._response([(message, reason, min(len(tokens), feed.room))], len(feed.ids))

    async def _serve(self, body: dict[str, Any]) -> dict[str, Any]:
        """Serve mode: a fresh one-call episode per sample, the request's own settings."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RefusedError(400, "messages: a non-empty list of chat messages is required")
        n, seed = int(body.get("n") or 1), body.get("seed")
        seed = int(seed) if seed is not None else secrets.randbelow(1 << 30)
        turn = int(body.get("max_completion_tokens") or body.get("max_tokens") or self.budget.turn_tokens)
        temperature, top_p = body.get("temperature"), body.get("top_p")
        sampling = (float(temperature) if temperature is not None else 1.0, float(top_p) if top_p is not None else 1.0)
        eps = [self._episode((0, i), seed, Budget(1, turn, 1 << 30)) for i in range(n)]
        feeds = [_fed(ep.begin(messages, body.get("tools") or None)) for ep in eps]
        outs = await asyncio.gather(*[asyncio.wrap_future(self.batcher.submit(ep.key, f, sampling))
                                      for ep, f in zip(eps, feeds)])
        choices = []
        for ep, f, (tokens, logprobs, finish, _routed) in zip(eps, feeds, outs):
            message, reason = ep.record(f, tokens, logprobs, finish, None)
            choices.append((message, reason, min(len(tokens), f.room)))
        return self._response(choices, len(feeds[0].ids))

    def _response(self, choices: list[tuple[dict[str, Any], str, int]], prompt_tokens: int) -> dict[str, Any]:
        completion = sum(c[2] for c in choices)
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": i, "message": {**m, "content": (m.get("content") or None) if m.get("tool_calls")
                                                     else m.get("content", "")},
                             "finish_reason": "tool_calls" if m.get("tool_calls") and reason == "stop" else reason,
                             "logprobs": None} for i, (m, reason, _) in enumerate(choices)],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    # ------------------------------------------------------------------ serving

    def app(self) -> Any:
        """The FastAPI application."""
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI(title="moe_rl gateway")

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                 "owned_by": "moe_rl"}]}

        async def chat(request: Request) -> Any:
            auth = request.headers.get("authorization", "")
            api_key = auth[7:] if auth.lower().startswith("bearer ") else None
            try:
                body = await request.json()
                return await self.complete(body, api_key)
            except RefusedError as r:
                return JSONResponse({"error": {"message": r.line, "type": "invalid_request_error",
                                               "code": r.status}}, status_code=r.status)
            except ValueError as e:
                return JSONResponse({"error": {"message": f"bad request: {' '.join(str(e).split())}",
                                               "type": "invalid_request_error", "code": 400}}, status_code=400)

        chat.__annotations__ = {"request": Request}  # (the class itself: this module's annotations are strings)
        app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
        return app

    def start(self) -> str:
        """Serve on 127.0.0.1 (`port`; 0: a free one) in a thread with its own event loop."""
        import uvicorn

        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="gateway-http", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the gateway could not serve on 127.0.0.1:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.url

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes (`.../v1`)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        """Stop serving (the port is closed when this returns) and the engine worker."""
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=30)
            self._server = None
        self.batcher.close()


__all__ = ["Gateway", "RefusedError", "normal", "refusal"]


def _fed(feed: Feed | None) -> Feed:
    """A serve-mode episode's first call (one turn, no episode limit: always fed)."""
    if feed is None:
        raise RuntimeError("a serve-mode episode's first call was refused by its own limits")
    return feed
