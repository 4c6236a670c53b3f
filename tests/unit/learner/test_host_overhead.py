"""The learner's host overhead, counted on a CPU (moe_rl_testing/host_overhead.py and
op_counter.py, which bench/cpu/bench_host_overhead.py reports): inside a micro-batch this project's code makes no operation that would
make a GPU's host wait for its queue (an item, a nonzero, a mask selection, a copy to the
host), under every routing setting the trainer runs (plain, capture, router shift, R2, R3);
what a pass reads back it reads once the pass is over. (The benchmark end to end:
tests/integration/bench/test_bench_host_overhead.py.) (The packed attention that Transformer Engine's THD attention replaces on a
GPU is left out: a GPU does not run it.)"""

from __future__ import annotations

import pytest
import torch

from moe_rl_testing import host_overhead as bench
from moe_rl_testing.op_counter import CPU_ONLY_AREAS, OpCounter

PASS_READS = 8
"""At most this many reads of the device per pass by the project (logprobs and metrics, the
routing record, statistics and replay counters): a few per step, whatever its size."""


@pytest.fixture(scope="module")
def counts(megatron_world):
    return bench.measure(bench.QUICK, warmup=False)


@pytest.mark.parametrize("setting", list(bench.SETTINGS))
def test_the_project_never_waits_for_the_device_inside_a_micro_batch(counts, setting):
    for part in ("score", "update"):
        summary = counts[setting][part]
        assert summary["microbatches"] == 2
        waits = [s for s in summary["syncs"] if s["region"] == "mb" and s["who"].startswith("project/")
                 and s["who"].removeprefix("project/") not in CPU_ONLY_AREAS]
        assert waits == [], f"{setting} {part}: {waits}"
        # (the count saw the micro-batches' work, and sees waits: megatron's CPU path has some)
        assert bench.total(summary, "launch", region="mb", owner="project") > 0
        assert bench.total(summary, "sync", region="mb", owner="megatron") > 0
        assert bench.total(summary, "sync", region="step", owner="project") <= PASS_READS


def test_routing_work_is_spent_only_where_a_setting_asks_for_it(counts):
    taps = {name: bench.per_mb(r["update"], "launch", "project", "routing taps") for name, r in counts.items()}
    assert taps["plain"] == 0  # (no capture, no replay, no padding: megatron routes alone)
    assert min(taps["capture"], taps["R2"], taps["R3"]) > 0
    checks = {name: bench.per_mb(r["update"], "launch", "project", "replay checks") for name, r in counts.items()}
    assert checks["capture"] == checks["router shift (rspo)"] == 0 < checks["R2"]


def test_the_counter_tells_device_reads_from_host_reads():
    class Owner:
        model = torch.nn.Linear(3, 3)
        optimizer = None

    with OpCounter(Owner()) as c:
        w = Owner.model.weight
        assert w.device == torch.device("cpu", 0)  # (what a device tensor reports while counting)
        float(w.sum())  # a device value read back: a wait
        host = torch.ones(3)
        float(host.sum())  # a host value: no wait
        moved = host.to(w.device, non_blocking=True)  # host to device: a copy, not a wait
        host.to(w.device)  # ... unless blocking: torch waits for the copy, so for the queue before it
        moved.cpu()  # device to host, blocking: a wait
        moved.to("cpu", non_blocking=True)  # into pinned memory on a GPU: no wait
        (moved > 0).nonzero()  # a data-dependent shape: a wait
    kinds = {k[3]: v for k, v in c.counts.items() if k[3] in ("sync", "h2d", "d2h_async")}
    assert kinds == {"sync": 4, "h2d": 2, "d2h_async": 1}, c.syncs


def test_the_critics_values_never_wait_for_the_device_inside_a_micro_batch(megatron_world):
    """PPO's critic reads its values at every [b, T] slot and zeroes the rest, instead of
    selecting the response slots with a boolean index (whose count a GPU's host would wait
    for in every micro-batch)."""
    from moe_rl.config import load_config
    from moe_rl.learner import parallel_layout
    from moe_rl.learner.critic import Critic

    cfg = load_config(None, bench.model_overrides(bench.QUICK))
    with parallel_layout(cfg.parallel, seed=0) as layout:
        critic = Critic(cfg.model, cfg.parallel, layout, optimizer=cfg.critic.optimizer, total_updates=1)
        critic.init_value_head(0.1, seed=0)
        batch = bench.step_batch(bench.QUICK, len(critic.taps.layers))
        with OpCounter(critic) as c:
            values_BT = critic.values(batch)
    assert c.microbatches == 2
    waits = [(who, w, what) for (region, who, w, what) in c.syncs if region == "mb" and who.startswith("project/")
             and who.removeprefix("project/") not in CPU_ONLY_AREAS]
    assert waits == []
    mask_BT = batch.tokens.response_mask()
    assert bool((values_BT[~mask_BT] == 0).all()) and bool((values_BT[mask_BT] != 0).all())
