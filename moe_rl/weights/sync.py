"""Weight sync from the learner to the engines: one `WeightSynchronizer`, chosen once.

    sync = make_weight_synchronizer(placement, bucket_mib=512)   # collective: every rank, once
    sync.attach(engine)                               # this rank's engine (None: it has none)
    metrics = sync.push(learner, version)             # every learner rank, after an update
    sync.receive()                                    # every engine-only rank, at the same point

The caller never branches on the placement; the factory does, once:
- `ColocatedSync` (every rank trains and hosts an engine, or a TP shard of one): every
  rank assembles the learner's full tensors, receiving only the pieces it lacks
  (`moe_rl.learner.gather.iter_full_tensors_everywhere`), and streams them into its own
  engine;
- `BroadcastSync` (separate placement, world > 1): global rank 0 assembles them and
  broadcasts each bucket (its names, shapes and dtypes first, then its tensors packed in one
  flat buffer: one collective a bucket, not one a tensor) over a group
  of itself and the engine ranks, which load it into their engines; an announcement without
  tensors ends the sync and names the version. The sends are asynchronous, from staged
  copies of the tensors (on a GPU: queued on the current stream, sent from NCCL's): the
  learner does not wait for the engines, which are generating the next batch under
  `rl.max_staleness`. An engine applies the weights when it calls `receive`: at its batch
  boundary, or between two decoding segments under `rl.inflight_weight_updates`
  (`moe_rl.rollout.segmented`; `poll` tells whether a push has begun); the engine has no
  requests in flight at either point;
  the learner's next push first waits for the previous one's sends to drain
  (`sync/drain_wait_seconds`), so at most one staged copy exists.

The learner's stream (`moe_rl.learner.export.hf_named_tensors`) runs collectives while it
is iterated, so every learner rank iterates it to the end and hands its engine one bucket
at a time: what an engine does with a bucket (vLLM enters its own process-group world for
the reload) can never change which collectives run. A bucket never splits a decoder layer:
vLLM finishes a layer's reload (the CPU MoE repack included) at the end of each call. The
bucket size is `sampler.weight_sync_bucket_mib`, the run's only one.

Versions: a push carries the learner's update count; every engine remembers the version it
holds (`held_version`), and the metrics name it (`sync/version`), so that rollouts can
later be tagged with the weights that sampled them.
"""

from __future__ import annotations

import math
import pickle
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moe_rl.rollout.placement import EnginePlacement
from moe_rl.runtime.fault_hooks import corrupt_bucket, corrupt_push_due
from moe_rl.runtime.worlds import bridge
from moe_rl.sampler import Sampler
from moe_rl.weights.delta import WireFormat
from moe_rl.weights.verify import (
    SyncCheck,
    SyncVerdict,
    SyncVerifier,
    SyncVerifyError,
    tensor_checksum,
    verdict_metrics,
)

if TYPE_CHECKING:
    from moe_rl.learner.protocols import PolicyLearner

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

Bucket = list[tuple[str, torch.Tensor]]
NamedTensors = Iterable[tuple[str, torch.Tensor]]


def layer_of(name: str) -> int | None:
    """Decoder layer index of a Hugging Face tensor name (None: embeddings, final norm, head)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def layer_buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[Bucket]:
    """Group a layer-ordered stream into buckets of at least `bucket_bytes` (the last may be
    smaller), cut only where the decoder layer changes."""
    bucket: Bucket = []
    size, current = 0, object()
    for name, tensor in named_tensors:
        layer = layer_of(name)
        if bucket and layer != current and size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        current = layer
    if bucket:
        yield bucket


def _nbytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


@dataclass
class SyncReport:
    """One weight sync, as seen by one rank."""

    version: int = 0
    """The learner's update count the weights come from."""
    seconds: float = 0.0
    """Wall time from the first gathered tensor to the last bucket loaded."""
    bytes_streamed: int = 0
    """Bytes of full tensors this rank drained from the learner or received by broadcast."""
    buckets: int = 0
    """Layer-aligned buckets (engine calls, where this rank has an engine)."""
    check: SyncCheck | None = None
    """What the engine compares itself against after this push (`sampler.verify_every`)."""
    delta_frac: float | None = None
    """Broadcast pushes: bytes put on the wire over those of the same tensors sent whole
    (1.0 for a full push; `sampler.sync=delta` sends less)."""

    def metrics(self) -> dict[str, float]:
        out = {"sync/version": float(self.version), "sync/seconds": self.seconds,
               "sync/bytes_streamed": float(self.bytes_streamed), "sync/buckets": float(self.buckets)}
        if self.delta_frac is not None:
            out["sync/delta_frac"] = self.delta_frac
        return out


def stream_in_buckets(named_tensors: NamedTensors, bucket_bytes: int,
                      load: Callable[[Bucket], None] | None) -> SyncReport:
    """Drain `named_tensors` in buckets, passing each to `load` (None: drain only, for a
    rank without an engine)."""
    report, t0 = SyncReport(), time.perf_counter()
    for bucket in layer_buckets(named_tensors, bucket_bytes):
        report.buckets += 1
        report.bytes_streamed += _nbytes(bucket)
        if load is not None:
            load(bucket)
    report.seconds = time.perf_counter() - t0
    return report


def _device() -> torch.device:
    """Where broadcast payloads live: the current GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class InFlight:
    """Asynchronous broadcasts a push has issued and the staged buffers they read: the
    learner goes on while they drain, and the next push (or the end of the run) waits."""

    def __init__(self) -> None:
        self.works: list[Any] = []
        self.buffers: list[torch.Tensor] = []  # alive until their broadcast completes

    def add(self, work: Any, buffer: torch.Tensor) -> None:
        self.works.append(work)
        self.buffers.append(buffer)

    def wait(self) -> float:
        """Block until every broadcast has completed; the seconds it took."""
        t0 = time.perf_counter()
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], []
        return time.perf_counter() - t0


_ALIGN = 16  # every tensor's bytes start at a multiple of this in a packed bucket (views by dtype)
Metas = list[tuple[str, tuple[int, ...], torch.dtype]]


def _metas(bucket: Bucket) -> Metas:
    return [(n, tuple(t.shape), t.dtype) for n, t in bucket]


def _spans(metas: Metas) -> tuple[list[tuple[int, int]], int]:
    """(byte offset, byte count) of each tensor in its bucket's flat buffer, and the buffer's
    size: the same on the sender and the receivers, from the shapes and dtypes alone."""
    spans, end = [], 0
    for _, shape, dtype in metas:
        n = math.prod(shape) * dtype.itemsize
        spans.append((end, n))
        end += -(-n // _ALIGN) * _ALIGN
    return spans, end


def _unpacked(flat: torch.Tensor, metas: Metas) -> Bucket:
    """Views of a bucket's flat buffer as the named tensors."""
    return [(name, flat[o:o + n].view(dtype).view(shape))
            for (name, shape, dtype), (o, n) in zip(metas, _spans(metas)[0])]


def _packed(bucket: Bucket, metas: Metas, dev: torch.device) -> torch.Tensor:
    """The bucket's tensors copied into one flat byte buffer on `dev`: the staged copy that
    the next update cannot change while it is in flight (on a GPU the copies are queued on
    the current stream, which the collective's stream waits for), sent in one collective."""
    flat = torch.empty(_spans(metas)[1], dtype=torch.uint8, device=dev)
    for (_, t), (_, view) in zip(bucket, _unpacked(flat, metas)):
        view.copy_(t.detach())
    return flat


def _meta_tensors(payload: Any) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8)
    return torch.tensor([data.numel()], dtype=torch.int64), data


def _send(t: torch.Tensor, group: dist.ProcessGroup | None, inflight: InFlight) -> None:
    inflight.add(dist.broadcast(t, src=0, group=group, async_op=True), t)


def broadcast_buckets(named_tensors: NamedTensors, bucket_bytes: int, group: dist.ProcessGroup | None, send: bool,
                      version: int, inflight: InFlight, wire: WireFormat | None = None,
                      check: SyncCheck | None = None, hashes: bool = False) -> SyncReport:
    """Drain `named_tensors`; with `send` (global rank 0), broadcast every bucket over
    `group` to the engine ranks (`receive_buckets`) without waiting for them: each bucket's
    names, shapes and dtypes (and, for a delta push, each tensor's kind), then its tensors
    (staged copies) as `wire` encodes them (`moe_rl.weights.delta`; None: as they come),
    then an end mark naming the version, all issued asynchronously into `inflight`. An
    engine takes them when it next calls `receive_buckets`, at its batch boundary. `check`
    (`sampler.verify_every`) goes with the end mark, with `hashes` the checksum of every
    tensor as the engine decodes it."""
    report, t0 = SyncReport(version), time.perf_counter()
    full = wire.next_push_is_full() if (wire is not None and send) else True
    whole = sent = 0
    for bucket in layer_buckets(named_tensors, bucket_bytes):
        report.buckets += 1
        report.bytes_streamed += _nbytes(bucket)
        if send:
            if check is not None and hashes:
                check.sums.update((n, tensor_checksum(wire.cast(n, t) if wire is not None else t)) for n, t in bucket)
            with bridge():
                dev = _device()
                out, kinds, n = wire.encode(bucket, full, dev) if wire is not None else (bucket, None, _nbytes(bucket))
                whole, sent = whole + n, sent + _nbytes(out)
                metas = _metas(out)
                for t in _meta_tensors((version, metas, kinds)):
                    _send(t.to(dev), group, inflight)
                _send(_packed(out, metas, dev), group, inflight)
    if send:
        with bridge():
            for t in _meta_tensors((version, None, check)):
                _send(t.to(_device()), group, inflight)
        report.delta_frac = sent / whole if whole else 1.0
    report.seconds = time.perf_counter() - t0
    return report


def _receive_meta(group: dist.ProcessGroup | None, dev: torch.device, posted: tuple[torch.Tensor, Any] | None = None) -> Any:
    """The next announcement; `posted`: its size already requested (`BroadcastSync.poll`)."""
    if posted is None:
        size = torch.empty(1, dtype=torch.int64, device=dev)
        dist.broadcast(size, src=0, group=group)
    else:
        size, work = posted
        work.wait()
    data = torch.empty(int(size), dtype=torch.uint8, device=dev)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.cpu().numpy().tobytes())  # (from global rank 0 of this run)


def receive_buckets(group: dist.ProcessGroup | None, load: Callable[[Bucket], None],
                    posted: tuple[torch.Tensor, Any] | None = None, wire: WireFormat | None = None) -> SyncReport:
    """An engine rank's side of `broadcast_buckets`: receive and load buckets until the end
    (`posted`: the first announcement's size, already requested), a delta push's patches
    applied by `wire` first (whether or not this rank still has an engine to load into)."""
    report, t0 = SyncReport(), time.perf_counter()
    whole = sent = 0
    while True:
        with bridge():
            dev = _device()
            report.version, metas, extra = _receive_meta(group, dev, posted)
            posted = None
            if metas is None:
                report.check = extra  # (the end mark: the push's check, if any)
                break
            kinds = extra
            flat = torch.empty(_spans(metas)[1], dtype=torch.uint8, device=dev)
            dist.broadcast(flat, src=0, group=group)
            received = _unpacked(flat, metas)
        bucket = wire.decode(received, kinds) if wire is not None else received
        report.buckets += 1
        report.bytes_streamed += _nbytes(bucket)
        whole, sent = whole + _nbytes(bucket), sent + _nbytes(received)
        load(bucket)
    report.delta_frac = sent / whole if whole else 1.0
    report.seconds = time.perf_counter() - t0
    return report


# --------------------------------------------------------------------------- synchronizers


class WeightSynchronizer(ABC):
    """Moves the learner's weights into this rank's engine; one per rank, for the whole run."""

    gather_dst: int | None
    """Where the learner assembles full tensors: every rank (None) or that global rank."""

    def __init__(self, placement: EnginePlacement, bucket_bytes: int) -> None:
        self.placement = placement
        self.bucket_bytes = bucket_bytes
        self.engine: Sampler | None = None
        self.held_version: int | None = None
        """The version this rank's engine holds; None: the weights it started from."""
        self.last_drain_seconds = 0.0
        """How long the previous push's asynchronous sends still took when this push began."""
        self.synced = False
        """A push has been made (a learner rank) or received (an engine rank) since this
        process started: an engine rebuilt from its starting weights then lacks the newest."""
        self.verifier: SyncVerifier | None = None
        """The engines' check after pushes (`sampler.verify_every`; None: never)."""
        self.engines_group: Any = None
        """The engine ranks' process group (`Engines` sets it; None: every rank)."""
        self._expected: dict[str, int] = {}
        self._raw: dict[str, int] = {}
        self._corrupt = self._hashing = False
        self.last_verdicts: list[SyncVerdict] = []
        """The engine ranks' verdicts on the last push they checked (an engine-only rank)."""

    def attach(self, engine: Sampler | None) -> None:
        """This rank's engine (None on a learner-only rank), once it has started."""
        self.engine = engine

    def push(self, learner: PolicyLearner, version: int) -> dict[str, float]:
        """A learner rank's side: drain the learner's weights (collective over the learner
        ranks, and with the engine ranks under `BroadcastSync`) into the engines, and return
        the sync's metrics, every learner rank's gathered (`sync/seconds_max`, per-rank ones)."""
        from moe_rl.learner.export import hf_named_tensors
        from moe_rl.learner.gather import SyncTraffic

        traffic = SyncTraffic()
        t0 = time.perf_counter()
        check = self.verifier.learner_side(learner, version) if self.verifier and self.verifier.due() else None
        learner_probe_seconds = time.perf_counter() - t0
        self._begin_receipt(check)
        report = self._deliver(hf_named_tensors(learner, dst=self.gather_dst, traffic=traffic), version, check)
        self.synced = True
        verdict = None
        if self.engine is not None:
            self.held_version = version
            if check is not None and self.gather_dst is None:  # (colocated: this rank's engine, now)
                verdict = self._verify(check)
        mine = {**report.metrics(), "sync/bytes_received": float(traffic.bytes_received),
                "sync/bytes_sent": float(traffic.bytes_sent), "sync/drain_wait_seconds": self.last_drain_seconds}
        everyone = learner.all_gather_object((mine, verdict))
        per_rank = {f"{k}_rank{r}": v for r, (m, _) in enumerate(everyone) if len(everyone) > 1 for k, v in m.items()
                    if k in ("sync/seconds", "sync/bytes_received")}
        out = {**mine, **per_rank, "sync/seconds_max": max(m["sync/seconds"] for m, _ in everyone)}
        if check is not None:
            out.update(_verified([v for _, v in everyone if v is not None], self.engine, learner_probe_seconds))
        return out

    def receive(self) -> SyncReport:
        """An engine-only rank's side (separate placement): load the weights rank 0 pushes."""
        raise RuntimeError(f"{type(self).__name__} has no engine-only ranks: every rank pushes")

    def poll(self) -> bool:
        """An engine-only rank's side: whether the learner's next push has begun to arrive
        (without waiting for it)."""
        raise RuntimeError(f"{type(self).__name__} has no engine-only ranks: every rank pushes")

    def take_checks(self) -> dict[str, float]:
        """An engine-only rank: the metrics of the last check its engines made after a push
        (`verdict_metrics`; {} when none since the last call). The engines report them with
        their next batch (`RolloutCollector.deliver`), so the learner logs the check of the
        push after step n in step n + 1's row."""
        verdicts, self.last_verdicts = self.last_verdicts, []
        return verdict_metrics(verdicts)

    def finish(self) -> None:  # noqa: B027 (a synchronizer without asynchronous sends has nothing to wait for)
        """Wait for anything a push left in flight (before the process groups go away)."""

    @abstractmethod
    def _deliver(self, named_tensors: NamedTensors, version: int, check: SyncCheck | None) -> SyncReport:
        """Drain the learner's stream to the end, handing the engines what they load (and,
        under `BroadcastSync`, `check` for them to compare themselves against)."""

    def _begin_receipt(self, check: SyncCheck | None) -> None:
        """Before this engine loads a push: what the checks after it collect, reset; the
        corruption test hook counts the push."""
        self._expected, self._raw = {}, {}
        self._hashing = check is not None and self.verifier is not None and self.verifier.hashes
        self._corrupt = self.engine is not None and corrupt_push_due()

    def _load(self, bucket: Bucket) -> None:
        if self.engine is None:  # (none: an engine dropped after a failure drains the push, loads nothing)
            return
        if self._hashing:
            from moe_rl.weights.verify import expected_checksums

            self._expected.update(expected_checksums(bucket, str(self.engine.precision)))
            if self.gather_dst is not None:  # (sent: the transport is checked too)
                self._raw.update((n, tensor_checksum(t)) for n, t in bucket)
        if self._corrupt:  # (the test hook: this engine loads one tensor changed)
            bucket, hit = corrupt_bucket(bucket)
            self._corrupt = not hit
        self.engine.update_weights(bucket)

    def _verify(self, check: SyncCheck) -> SyncVerdict:
        """This rank's engine against `check`, right after the push was loaded."""
        if self.verifier is None or self.engine is None:
            raise RuntimeError("a push is verified only with sampler.verify_every > 0, on a rank with an engine")
        return self.verifier.engine_side(self.engine, self.placement.rank, check, self._expected, self._raw)


class ColocatedSync(WeightSynchronizer):
    """Every rank assembles the full tensors and streams them into its own engine (shard)."""

    gather_dst = None

    def _deliver(self, named_tensors: NamedTensors, version: int, check: SyncCheck | None) -> SyncReport:
        report = stream_in_buckets(named_tensors, self.bucket_bytes, self._load if self.engine is not None else None)
        report.version = version
        return report


class BroadcastSync(WeightSynchronizer):
    """Rank 0 assembles the full tensors and broadcasts them to the engine-only ranks."""

    gather_dst = 0

    def __init__(self, placement: EnginePlacement, bucket_bytes: int, wire: WireFormat | None = None) -> None:
        super().__init__(placement, bucket_bytes)
        self.group = placement.weights_group()  # collective: every rank creates it here
        self.inflight = InFlight()
        self._posted: tuple[torch.Tensor, Any] | None = None
        self.wire = wire or WireFormat()
        """What travels (`sampler.sync`): rank 0 encodes with it, an engine rank decodes."""

    def _deliver(self, named_tensors: NamedTensors, version: int, check: SyncCheck | None) -> SyncReport:
        send = self.placement.rank == 0
        self.last_drain_seconds = self.inflight.wait()  # (one staged copy of the weights at a time)
        hashes = self.verifier is not None and self.verifier.hashes
        return broadcast_buckets(named_tensors, self.bucket_bytes, self.group, send, version, self.inflight,
                                 self.wire, check if send else None, hashes)

    def finish(self) -> None:
        self.inflight.wait()

    def receive(self) -> SyncReport:
        """(Under `sampler.verify_every`, a push that comes with a check is compared right
        after it is loaded, agreed over the engine ranks: `SyncVerifyError` on each.)"""
        posted, self._posted = self._posted, None
        # (rank 0 checks every `every`-th push it sends and this rank receives each one: the
        # same count says whether this push is checked, so checksums are taken only then)
        due = self.verifier is not None and self.verifier.due()
        self._begin_receipt(SyncCheck(0, []) if due else None)
        report = receive_buckets(self.group, self._load, posted, self.wire)
        self.held_version, self.synced = report.version, True
        if (report.check is not None) != due:
            raise RuntimeError(f"push {report.version} came {'with' if report.check else 'without'} a check, but "
                               f"this engine rank counted {self.verifier.pushes if self.verifier else 0} pushes "
                               "(sampler.verify_every): the learner and engine ranks disagree on the pushes made")
        if report.check is not None:
            verdict = self._verify(report.check) if self.engine is not None else None
            verdicts = [v for v in self.placement.all_engines(verdict, self.engines_group) if v is not None]
            self.last_verdicts = verdicts
            failed = [v for v in verdicts if v.failed]
            if failed:
                raise SyncVerifyError(failed[0].line(str(getattr(self.engine, "precision", "fp32"))))
        return report

    def poll(self) -> bool:
        # The push's first collective (its announcement's size), requested once and asynchronously:
        # the sender's broadcasts are already asynchronous, so completion means the push has begun.
        if self._posted is None:
            with bridge():
                size = torch.empty(1, dtype=torch.int64, device=_device())
                self._posted = (size, dist.broadcast(size, src=0, group=self.group, async_op=True))
        return bool(self._posted[1].is_completed())


def make_weight_synchronizer(placement: EnginePlacement, *, bucket_mib: int, sync: str = "full",
                             full_sync_every: int = 1, precision: str | None = None) -> WeightSynchronizer:
    """The synchronizer of this run's placement, sending buckets of `bucket_mib` MiB (the
    run's `sampler.weight_sync_bucket_mib`); to separate engine ranks as `sync` says (full or
    delta, whole every `full_sync_every` pushes: `moe_rl.weights.delta`), in the dtype of
    the sampler's resolved `precision` where that is a plain cast. Collective (every rank,
    once, at the same point): the broadcast variant creates its process group here."""
    bucket_bytes = bucket_mib << 20
    if placement.engine_ranks and placement.world > 1:
        return BroadcastSync(placement, bucket_bytes, WireFormat(sync, full_sync_every, precision))
    return ColocatedSync(placement, bucket_bytes)


def _verified(verdicts: list[SyncVerdict], engine: Any, learner_seconds: float) -> dict[str, float]:
    """The check's metrics over the engine ranks' verdicts (colocated: every rank's; none
    under the separate placement, whose engines check themselves when they load the push),
    or the run's end: `SyncVerifyError` naming the first engine rank that failed (on every
    rank alike, rank 0 prints it)."""
    failed = [v for v in verdicts if v.failed]
    if failed:
        raise SyncVerifyError(failed[0].line(str(getattr(engine, "precision", "fp32"))), everywhere=True)
    return {"sync/verify_learner_seconds": learner_seconds, **verdict_metrics(verdicts, learner_seconds)}
