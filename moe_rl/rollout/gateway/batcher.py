"""The gateway's engine calls: requests waiting together go into one `Sampler.generate`.

    batcher = EngineBatcher(sampler, temperature, top_p, turn_tokens, window_s)
    future = batcher.submit(key, feed)      # from the server's event loop
    ...                                     # (a worker thread decodes the batch)
    batcher.close()

A batch is flushed when every open episode has a request waiting (`expect(n)`: the episodes
the rollout opened and has not closed), or once no further request has arrived for
`window_s`, whichever comes first; its rows go in episode-key order (group, response), which is the order the tool
episodes' pool feeds them in, so the same episodes through an agent decode the same batches.
Every row is decoded to `turn_tokens` (the run's rl.max_turn_tokens) and cut at its own room
by the episode (`AgentEpisode.record`), as the pool does. The engine is called from this
one worker thread only.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from moe_rl.rollout.gateway.trajectory import Feed

WINDOW_S = 0.05
"""How long a batch waits for a further request after the last one arrived (unless every
open episode has one waiting before)."""


@dataclass
class Waiting:
    """One queued row: its episode, what the engine is fed, the caller's future and the
    row's (temperature, top_p)."""

    key: tuple[int, int]
    feed: Feed
    future: Future
    sampling: tuple[float, float]


class EngineBatcher:
    """One worker thread feeding the engine the requests that wait together."""

    def __init__(self, sampler: Any, temperature: float, top_p: float, turn_tokens: int | None,
                 window_s: float = WINDOW_S) -> None:
        """`turn_tokens`: tokens every row is decoded to (None: the batch's largest room)."""
        self.sampler, self.temperature, self.top_p = sampler, temperature, top_p
        self.turn_tokens, self.window_s = turn_tokens, window_s
        self._cv = threading.Condition()
        self._waiting: list[Waiting] = []
        self._open = 0
        self._closed = False
        self.batches = 0
        """Engine calls made (the statistics; the tests)."""
        self._thread = threading.Thread(target=self._loop, name="gateway-engine", daemon=True)
        self._thread.start()

    def expect(self, open_episodes: int) -> None:
        """Episodes that may still send a request (a batch is full when each has one waiting)."""
        with self._cv:
            self._open = open_episodes
            self._cv.notify_all()

    def submit(self, key: tuple[int, int], feed: Feed, sampling: tuple[float, float] | None = None) -> Future:
        """Queue one row (`sampling`: its (temperature, top_p) when not the run's: serve mode);
        its future gets (tokens, logprobs, finish, routes)."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                fut.set_exception(RuntimeError("the gateway is closed"))
                return fut
            self._waiting.append(Waiting(key, feed, fut, sampling or (self.temperature, self.top_p)))
            self._cv.notify_all()
        return fut

    def drop(self, key: tuple[int, int]) -> None:
        """Forget a closed episode's waiting request (its agent was cancelled or abandoned)."""
        with self._cv:
            for w in self._waiting:
                if w.key == key:
                    w.future.cancel()
            self._waiting = [w for w in self._waiting if w.key != key]
            self._cv.notify_all()

    def _take(self) -> list[Waiting] | None:
        with self._cv:
            while not self._waiting and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            deadline, seen = time.monotonic() + self.window_s, len(self._waiting)
            while not self._closed and len(self._waiting) < self._open and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
                if len(self._waiting) > seen:  # (a new arrival: the window starts again)
                    deadline, seen = time.monotonic() + self.window_s, len(self._waiting)
            batch, self._waiting = sorted(self._waiting, key=lambda w: w.key), []
            return batch

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            batch = [w for w in batch if w.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                self._decode(batch)
            except Exception as e:  # (the engine failed: every waiting call answers with it)
                for w in batch:
                    if not w.future.done():
                        w.future.set_exception(e)

    def _decode(self, batch: list[Waiting]) -> None:
        for sampling in dict.fromkeys(w.sampling for w in batch):  # (one call per setting: serve mode)
            self._call([w for w in batch if w.sampling == sampling], *sampling)

    def _call(self, batch: list[Waiting], temperature: float, top_p: float) -> None:
        tokens = self.turn_tokens or max(w.feed.room for w in batch)
        ro = self.sampler.generate([w.feed.ids for w in batch], n=1, max_new_tokens=max(tokens, 1),
                                   temperature=temperature, top_p=top_p, prompt_seeds=[w.feed.seed for w in batch])
        self.batches += 1
        for i, fut in enumerate(w.future for w in batch):
            routed = ro.routed_experts[i] if ro.routed_experts is not None else None
            fut.set_result((ro.response_token_ids[i], ro.logprobs[i], ro.finish_reasons[i], routed))

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for w in self._waiting:
                w.future.cancel()
            self._waiting = []
            self._cv.notify_all()
        self._thread.join(timeout=60)
