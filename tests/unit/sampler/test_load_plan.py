"""The direct weight reload's pieces that need no engine: the recorded load plan, the scratch
pool and the rebind-or-copy rule (`moe_rl/sampler/_load_plan.py`, `_direct_reload.py`)."""

from __future__ import annotations

import torch

from moe_rl.sampler._direct_reload import ScratchPool, same_layout, sole_owner
from moe_rl.sampler._load_plan import record_plan, signature


class Block(torch.nn.Module):
    """A toy layer whose loader does what vLLM's do: a fused [q; kv] weight filled from two
    checkpoint tensors by narrow + copy, a padded vocabulary (copy + zero fill), a norm."""

    def __init__(self, d: int = 4, vocab: int = 5, padded: int = 8) -> None:
        super().__init__()
        self.qkv = torch.nn.Module()
        self.qkv.weight = torch.nn.Parameter(torch.empty(3 * d, d), requires_grad=False)
        self.emb = torch.nn.Module()
        self.emb.weight = torch.nn.Parameter(torch.empty(padded, d), requires_grad=False)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(d))  # (requires grad, as vLLM's RMSNorm's)
        self.d, self.vocab = d, vocab
        self.calls = 0

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.calls += 1
        d = self.d
        for name, t in tensors:
            if name == "q":
                self.qkv.weight.data.narrow(0, 0, d).copy_(t)
            elif name == "kv":
                self.qkv.weight.data.narrow(0, d, 2 * d).copy_(t)
            elif name == "emb":
                self.emb.weight.data[: self.vocab].copy_(t)
                self.emb.weight.data[self.vocab:].fill_(0)
            elif name == "norm":
                self.norm.weight.data.copy_(t.t().t())  # (views of the source are fine)
        return {"qkv.weight", "emb.weight", "norm.weight"}


def checkpoint(seed: int, d: int = 4, vocab: int = 5) -> list[tuple[str, torch.Tensor]]:
    """The tensors as one flat bucket holds them: views into one storage."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (d, d), "kv": (2 * d, d), "emb": (vocab, d), "norm": (d,)}
    flat = torch.randn(sum(torch.Size(s).numel() for s in shapes.values()) + 3, generator=g)
    out, at = [], 3  # (an offset: tensors do not start at their storage's beginning)
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        out.append((name, flat[at:at + n].view(shape)))
        at += n
    return out


def test_a_replayed_plan_writes_what_the_loaders_write_bit_for_bit():
    block = Block()
    loaded, plan = record_plan(block, "", checkpoint(0), block.load)
    assert plan is not None and loaded == plan.loaded == {"qkv.weight", "emb.weight", "norm.weight"}
    assert len(plan.copies) == 5  # q, kv, emb rows, the padding fill, norm
    fresh = checkpoint(1)
    want = Block()
    want.load(fresh)
    block.qkv.weight.data.fill_(float("nan"))
    block.emb.weight.data.fill_(float("nan"))  # (the fill must be replayed too)
    assert plan.replay(block, "", fresh) == plan.loaded
    for a, b in zip(block.state_dict().values(), want.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(block.emb.weight[5:], torch.zeros(3, 4))


def test_the_plan_is_checked_against_the_loaders_before_it_is_trusted():
    """The check's sequence (DirectReload._load_tensors): loaders, snapshot, poison, replay,
    compare; a replay that misses even a byte already holding the loaders' value fails it."""
    block = Block()
    _, plan = record_plan(block, "", checkpoint(0), block.load)
    assert plan is not None
    fresh = checkpoint(2)
    block.load(fresh)
    snap = plan.snapshot(block, "")
    plan.poison(block, "")
    assert not plan.matches(block, "", snap)
    plan.replay(block, "", fresh)
    assert plan.matches(block, "", snap)
    plan.copies = [c for c in plan.copies if c[1] is not None]  # (a plan that lost the padding fill)
    block.load(fresh)
    snap = plan.snapshot(block, "")
    plan.poison(block, "")
    plan.replay(block, "", fresh)
    assert not plan.matches(block, "", snap)  # (the zeros were already there: only the poison shows it)
    plan.restore(block, "", snap)
    assert plan.matches(block, "", snap)
    assert signature(fresh) == plan.key
    assert signature([(n, t.double()) for n, t in fresh]) != plan.key


def test_loading_that_is_not_plain_copies_is_not_planned():
    block = Block()

    def computed(tensors):  # (a transform before the copy: the source is a new tensor)
        for name, t in tensors:
            if name == "q":
                block.qkv.weight.data.narrow(0, 0, 4).copy_(t * 2)
        return {"qkv.weight"}

    def scaled_in_place(tensors):
        block.load(tensors)
        block.qkv.weight.data.mul_(2)
        return {"qkv.weight"}

    def outside(tensors):
        torch.empty(4, 4).copy_(tensors[0][1])
        return set()

    def rebinds(tensors):
        block.norm.weight.data = tensors[3][1].clone()
        return {"norm.weight"}

    def replaces(tensors):
        block.load(tensors)
        block.norm.weight = torch.nn.Parameter(tensors[3][1].clone())
        return {"norm.weight"}

    def branches_on_values(tensors):
        if tensors[0][1][0, 0].item() > 0:
            block.qkv.weight.data.narrow(0, 0, 4).copy_(tensors[0][1])
        return {"qkv.weight"}

    for load in (computed, scaled_in_place, outside, rebinds, replaces, branches_on_values):
        _, plan = record_plan(block, "", checkpoint(0), load)
        assert plan is None, load.__name__


def test_a_group_is_addressed_below_the_model_root():
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([Block(), Block()])
    block = root.layers[1]
    _, plan = record_plan(block, "layers.1", checkpoint(0), block.load)
    assert plan is not None and {p for _, _, p, _, _ in plan.copies} == {"layers.1.qkv", "layers.1.emb", "layers.1.norm"}
    plan.replay(block, "layers.1", checkpoint(3))
    want = Block()
    want.load(checkpoint(3))
    assert torch.equal(block.qkv.weight, want.qkv.weight)


def test_the_scratch_pool_reuses_memory_and_drops_what_is_held_elsewhere():
    pool, like = ScratchPool(), torch.empty(4, 8, device="meta")
    a = pool.take(like, torch.device("cpu"))
    b = pool.take(like, torch.device("cpu"))
    ptrs = {a.data_ptr(), b.data_ptr()}
    assert len(ptrs) == 2 and a.shape == (4, 8)
    del a, b
    pool.give_back()
    assert pool.nbytes == 2 * 4 * 8 * 4
    c = pool.take(like, torch.device("cpu"))
    assert c.data_ptr() in ptrs  # (the same memory, warm: no page faults)
    held = c.data  # (another tensor keeps the slot's storage: it must leave the pool)
    del c
    pool.give_back()
    assert pool.nbytes == 4 * 8 * 4
    d = pool.take(like, torch.device("cpu"))
    old = torch.zeros(4, 8)  # (a live tensor's former storage, offered in the slot's place)
    pool.offer(old)
    kept = d.data
    del d
    pool.give_back()
    assert pool.nbytes == 4 * 8 * 4 and held.data_ptr() != kept.data_ptr()
    assert pool.take(like, torch.device("cpu")).data_ptr() == old.data_ptr()


def test_a_pool_that_keeps_nothing():
    """(On a GPU: the caching allocator reuses blocks; no standing memory outside vLLM's budget.)"""
    pool, like = ScratchPool(keep=False), torch.empty(4, 8, device="meta")
    a = pool.take(like, torch.device("cpu"))
    del a
    pool.give_back()
    assert pool.nbytes == 0


def test_rebind_only_where_a_kernel_could_not_tell():
    live = torch.nn.Parameter(torch.zeros(4, 8), requires_grad=False)
    assert sole_owner(live)
    view = live.data[1:]
    assert not sole_owner(live)  # (a view elsewhere would go stale)
    del view
    assert not sole_owner(torch.zeros(8, 8)[:4])  # (a view into a larger block)
    assert same_layout(live, torch.ones(4, 8))
    assert not same_layout(live, torch.ones(8, 4).t())  # (other strides)
    assert not same_layout(live, torch.ones(4, 8, dtype=torch.float64))
    assert not same_layout(live, torch.ones(5, 8)[1:])  # (an offset)
