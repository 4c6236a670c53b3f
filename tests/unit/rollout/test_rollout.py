"""The rollout package's pieces that need no engine: engine placement, per-prompt seeds,
layer-aligned weight-sync buckets."""

from __future__ import annotations

import pytest
import torch

from moe_rl.rollout.placement import EnginePlacement
from moe_rl.sampler.base import base_seeds, expand_seeds, sample_seeds


@pytest.mark.parametrize(("world", "tp", "prompts"), [(1, 1, 16), (2, 1, 16), (2, 1, 5), (4, 2, 7), (8, 1, 3)])
def test_engine_shares_cover_the_prompts_once_in_order(world, tp, prompts):
    shares = {}
    for rank in range(world):
        p = EnginePlacement(world, rank, tp)
        assert p.engines == world // tp and p.engine == rank // tp and p.leader == (rank % tp == 0)
        shares.setdefault(p.engine, list(p.share(prompts)))
        assert list(p.share(prompts)) == shares[p.engine]  # a group's ranks sample the same block
    flat = [i for e in range(world // tp) for i in shares[e]]
    assert flat == list(range(prompts))
    sizes = [len(s) for s in shares.values()]
    assert max(sizes) - min(sizes) <= 1


def test_per_prompt_seeds_make_a_split_batch_sample_like_a_whole_one():
    whole = sample_seeds(11, num_prompts=6, n=4)
    bases = base_seeds(11, 6, 4)
    halves = expand_seeds(bases[:3], 3, 4) + expand_seeds(bases[3:], 3, 4)
    assert halves == whole and len(set(whole)) == 24
    with pytest.raises(ValueError, match="prompt_seeds has 2 seeds for 3 prompts"):
        expand_seeds(bases[:2], 3, 4)


def test_a_weight_sync_never_depends_on_the_consumer():
    """The learner's full-tensor stream is drained by the trainer in buckets; a bucket is
    handed to the engine whole, so a consumer that stops early changes nothing upstream."""
    from moe_rl.weights.sync import layer_buckets, stream_in_buckets

    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a",
             "model.layers.10.a", "model.norm.weight", "lm_head.weight"]
    stream = [(n, torch.zeros(256)) for n in names]  # 1 KiB each
    buckets = list(layer_buckets(stream, bucket_bytes=1500))
    assert [[n for n, _ in b] for b in buckets] == [names[:3], names[3:5], names[5:]]
    pulled = []

    def lazy():
        for item in stream:
            pulled.append(item[0])
            yield item

    report = stream_in_buckets(lazy(), 1 << 30, load=lambda bucket: None)  # a consumer that reads nothing
    assert pulled == names and report.buckets == 1 and report.bytes_streamed == 7 * 1024
