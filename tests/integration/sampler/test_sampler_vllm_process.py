"""The vLLM sampler with its engine in a separate process (`in_process=False`).

The layout for large runs, where the engine cannot take the trainer's iterator: weight
sync goes through a temporary safetensors directory and the reload (with the CPU MoE
repack) runs inside the engine's worker process through the worker extension.

The same engine shows what a hung out-of-process engine does (issue 65): its engine-core
process stopped (SIGSTOP: a real deadlock, nothing in this process is faked), the generate
call outlives `sampler.generate_timeout_s`, `Engines` kills the engine (`VLLMSampler.kill`),
the pending call fails, the engine process is gone, and the engine rebuilt under
`sampler.max_restarts` retries the call with its seeds: the same rollouts, then a sync.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing import connection

import pytest

from moe_rl_testing.sampler_utils import (
    build_tiny_moe,
    max_abs_untied,
    perturbed,
    prompts,
    save_stream,
)

pytest.importorskip("vllm")

from moe_rl.config import RLConfig, SamplerConfig
from moe_rl.rollout.collector import FixedWeights
from moe_rl.rollout.engines import Engines
from moe_rl.rollout.placement import EnginePlacement
from moe_rl.sampler import VLLMEngineConfig, make_sampler
from moe_rl.sampler.hf_backend import HFSampler

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TIMEOUT_S = 8.0
"""sampler.generate_timeout_s of the hung call (the normal calls take well under 1 s)."""
MARGIN_S = 30.0
"""How long after the deadline the engine process may still exist (a hang guard, not a
timing test: measured well under 1 s)."""


def _engines(model_dir, tmp_path) -> Engines:
    """One process's `Engines` (world 1, no process group) on an out-of-process engine, one
    restart allowed; each (re)build is the small engine of this file."""
    engines = Engines(EnginePlacement(world=1, rank=0, ranks_per_engine=1), FixedWeights(),
                      sampler=SamplerConfig(backend="vllm", in_process=False, max_restarts=1), rl=RLConfig(),
                      seed=0, trust_checkpoint=False)
    engines._build = lambda hf_dir, group_env: make_sampler(  # type: ignore[method-assign]
        hf_dir, VLLMEngineConfig(kv_cache_gib=0.0625, in_process=False, weight_sync_bucket_mib=1))
    engines.start(tmp_path, model_dir, [])
    return engines


def _core_process(engines: Engines):
    (proc,) = engines.sampler.llm.llm_engine.engine_core.resources.engine_manager.processes
    return proc


def test_separate_engine_process_generates_syncs_and_is_killed_when_hung(tmp_path, caplog):
    import psutil

    model_dir = build_tiny_moe(tmp_path / "hf")
    engines = _engines(model_dir, tmp_path)
    args = dict(n=4, max_new_tokens=16, temperature=0.8, seed=5)
    try:
        assert engines.sampler.weight_sync == "disk" and not engines.sampler.in_process
        before = engines.generate("generating step 1", prompts(6), **args)

        core = _core_process(engines)
        workers = psutil.Process(core.pid).children(recursive=True)
        died: list[float] = []
        watcher = threading.Thread(target=lambda: connection.wait([core.sentinel], TIMEOUT_S + MARGIN_S + 60)
                                   and died.append(time.monotonic()), daemon=True)
        watcher.start()
        engines.sampler_cfg = SamplerConfig(backend="vllm", in_process=False, max_restarts=1,
                                            generate_timeout_s=TIMEOUT_S)
        os.kill(core.pid, signal.SIGSTOP)  # (the engine deadlocks: the call below never gets a result)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="moe_rl.rollout"):
            retried = engines.generate("generating step 2", prompts(6), **args)
        watcher.join(TIMEOUT_S + MARGIN_S + 60)
        assert died and died[0] - t0 < TIMEOUT_S + MARGIN_S, (died, t0)
        assert not core.is_alive() and core.exitcode == -signal.SIGKILL
        _, alive = psutil.wait_procs(workers, timeout=MARGIN_S)
        assert not alive, alive  # (its worker processes follow it)
        assert "the engine on rank 0 hung while generating step 2: no result after 8 s" in caplog.text
        assert "engine rank 0 failed while generating step 2" in caplog.text and engines.restarts.used == 1
        assert _core_process(engines).pid != core.pid and _core_process(engines).is_alive()
        assert (retried.response_token_ids, retried.logprobs) == (before.response_token_ids, before.logprobs)

        s = engines.sampler  # (the rebuilt engine takes a push as the first did)
        s.update_weights(perturbed(model_dir))
        ref = HFSampler(save_stream(perturbed(model_dir), model_dir, tmp_path / "new"))
        r = s.generate(prompts(6), **args)
        P, R = [r.prompt_token_ids[i] for i in r.prompt_index], r.response_token_ids
        assert max_abs_untied(r.logprobs, ref.score(P, R, 0.8), P, R, ref.model) < 1e-4
    finally:
        engines.close()
