"""`join_rl_world`: only the ranks that train import megatron-core and take its patches
(tests/integration/runtime/test_engine_rank_imports.py checks, in a fresh process, that an
engine-only rank's modules import none of it)."""

from __future__ import annotations

from moe_rl_testing import ROOT


def test_only_the_ranks_that_train_take_megatrons_patches(monkeypatch):
    """`join_rl_world` on each rank of a 3-rank job with one engine rank, and of a
    co-located one: `init_distributed` (megatron-core's import and patches) runs on the
    learner ranks only."""
    import moe_rl.learner
    import moe_rl.runtime.process_group
    from moe_rl.config import load_config
    from moe_rl.programs.rl.learner_role import join_rl_world

    calls: list[tuple[int, int]] = []
    for overrides, engine_ranks in ((["sampler.placement=separate", "sampler.engine_ranks=1"], 1), ([], 0)):
        cfg = load_config(ROOT / "examples" / "tiny_rspo.yaml", overrides)
        for rank in range(3):
            monkeypatch.setattr(moe_rl.runtime.process_group, "join_world",
                                lambda backend, engine_ranks=0, rank=rank: (rank, 3))
            monkeypatch.setattr(moe_rl.learner, "init_distributed",
                                lambda backend, engine_ranks=0, rank=rank: calls.append((rank, engine_ranks)))
            assert join_rl_world(cfg) == (rank, 3)
    assert calls == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 0)]
