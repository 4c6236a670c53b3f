"""Is the engine computing with the weights the learner pushed? (`sampler.verify_every`)

    verifier = SyncVerifier(every, probe, step_of=...)   # the run's probe batch, drawn once
    check = verifier.learner_side(learner, push)         # every learner rank, after a due push
    result = verifier.engine_side(engine, rank, check, expected, raw)  # each engine rank, after the load
    if result.failed: raise SyncVerifyError(result.line(precision))     # one line, exit 3

After every k-th push each engine scores a fixed probe batch (a few short sequences drawn
once from run.seed, `probe_batch`) and the learner scores the same batch with the weights it
pushed; the comparison is made where the engine is (colocated: on each rank; separate: rank 0
sends the learner's log-probs with the push's end mark). The largest |log-prob difference|
over the probe's tokens must stay within `TOLERANCE[precision]`, measured on the demo model.
An engine that holds its weights as plain parameters (the transformers sampler,
`held_tensor`) is also checked tensor by tensor: a checksum of what it holds after the
load against one of the learner's export (`tensor_checksum`, exact on the bits), sent along
the same way. The comparison happens right after the push is loaded, before the engine is
asked for a sample, so no rollout is taken with weights that fail it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moe_rl.rollout.engine_faults import EngineFailedError
from moe_rl.sampler.precision import transform_weight

TOLERANCE: dict[str, float] = {"fp32": 1e-4, "bf16": 1.5, "fp8_emulated": 1.5, "fp8": 2.0}
"""Largest |engine - learner| log-prob over the probe's tokens that a correct push shows, per
resolved `sampler.precision` (docs/sampler.md has the measurements: fp32 ~1e-6 on the demo
model; bf16 and fp8_emulated compute in bf16 against the fp32 learner, whose single-token
differences reach 0.4 in a clean 20-step run: there the mean below decides)."""
MEAN_TOLERANCE: dict[str, float] = {"fp32": 1e-4, "bf16": 0.06, "fp8_emulated": 0.08, "fp8": 0.1}
"""The same for the mean |difference| over the probe's tokens: at low precision a single
token's difference is noisy, the mean is what a wrong tensor moves."""

PROBE_ROWS, PROBE_RESPONSE_TOKENS = 4, 8
_CHUNK = 1 << 22
_MOD = 65521


def tensor_checksum(t: torch.Tensor) -> int:
    """A position-weighted sum of the tensor's bytes (exact: any changed bit or moved
    element changes it, bar collisions), computed in chunks of bounded memory."""
    flat = t.detach().contiguous().reshape(-1).cpu().view(torch.uint8)
    total = 0
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK].to(torch.int64)
        weights = (torch.arange(start, start + part.numel(), dtype=torch.int64) % _MOD) + 1
        total = (total + int((part * weights).sum())) % (1 << 61)
    return total


def expected_checksums(bucket: Sequence[tuple[str, torch.Tensor]], precision: str) -> dict[str, int]:
    """What an engine of `precision` that loaded `bucket` faithfully holds, per tensor."""
    return {name: tensor_checksum(transform_weight(name, t, precision)) for name, t in bucket}


def probe_batch(prompts: Sequence[Sequence[int]], seed: int, rows: int = PROBE_ROWS,
                response_tokens: int = PROBE_RESPONSE_TOKENS) -> tuple[list[list[int]], list[list[int]]]:
    """The run's probe: `rows` of the given prompts, each followed by `response_tokens` token
    ids drawn from the prompts' own tokens (valid ids for any engine), from `seed` alone."""
    rng = np.random.default_rng([seed, 6565])
    chosen = [list(map(int, prompts[i % len(prompts)])) for i in range(rows)]
    pool = sorted({t for p in chosen for t in p})
    responses = [[pool[int(j)] for j in rng.integers(0, len(pool), response_tokens)] for _ in chosen]
    return chosen, responses


@dataclass
class SyncCheck:
    """What an engine compares itself against after one push: the learner's probe log-probs
    and (for engines with plain parameters) the checksums of the tensors it was sent."""

    version: int
    logp: list[list[float]]
    sums: dict[str, int] = field(default_factory=dict)
    """The learner's export: tensor name -> `tensor_checksum` of the tensor as streamed."""


@dataclass
class SyncVerdict:
    """One engine rank's comparison after a push."""

    rank: int
    version: int
    max_abs_diff: float
    tolerance: float
    seconds: float
    bad_tensors: list[str] = field(default_factory=list)
    mean_abs_diff: float = 0.0
    mean_tolerance: float = float("inf")

    @property
    def failed(self) -> bool:
        return (not self.max_abs_diff <= self.tolerance or not self.mean_abs_diff <= self.mean_tolerance
                or bool(self.bad_tensors))

    def line(self, precision: str) -> str:
        """The one line the run stops with."""
        held = (f"; {len(self.bad_tensors)} held tensor(s) differ from the learner's export, first "
                f"{self.bad_tensors[0]}") if self.bad_tensors else ""
        return (f"engine rank {self.rank} does not hold the weights pushed after step {self.version}: its probe "
                f"log-probs differ from the learner's by up to {self.max_abs_diff:.3g}, {self.mean_abs_diff:.3g} on "
                f"average (tolerances {self.tolerance:g} and {self.mean_tolerance:g} at sampler.precision={precision})"
                f"{held}; the run stops before sampling with them, the last "
                "checkpoint stays the latest: check the engine's weight loading (sampler.verify_every found it)")


def verdict_metrics(verdicts: Sequence[SyncVerdict], extra_seconds: float = 0.0) -> dict[str, float]:
    """The check's metrics over the engine ranks' verdicts on one push (none: {}):
    `sync/verify_max_abs_diff` and `sync/verify_mean_abs_diff` (the largest over the
    engines), `sync/verify_seconds` (the slowest engine's, plus `extra_seconds`: the
    learner's probe where it is taken in the same push) and `sync/verify_version` (the push)."""
    if not verdicts:
        return {}
    return {"sync/verify_max_abs_diff": max(v.max_abs_diff for v in verdicts),
            "sync/verify_mean_abs_diff": max(v.mean_abs_diff for v in verdicts),
            "sync/verify_seconds": max(v.seconds for v in verdicts) + extra_seconds,
            "sync/verify_version": float(max(v.version for v in verdicts))}


class SyncVerifyError(EngineFailedError):
    """An engine failed the check after a push: the run stops before it samples."""


class SyncVerifier:
    """The run's probe batch and how often it is used; shared by the learner and engine sides."""

    def __init__(self, every: int, prompts: list[list[int]], responses: list[list[int]], *, hashes: bool,
                 seq_multiple: int = 1, pad_id: int = 0) -> None:
        """`hashes`: compare tensor checksums too (the engines hold plain parameters)."""
        self.every, self.prompts, self.responses, self.hashes = every, prompts, responses, hashes
        self.seq_multiple, self.pad_id = seq_multiple, pad_id
        self.pushes = 0

    def due(self) -> bool:
        """Count one push; whether it is checked."""
        self.pushes += 1
        return self.every > 0 and self.pushes % self.every == 0

    def learner_side(self, learner: Any, version: int) -> SyncCheck:
        """The learner's probe log-probs with its current weights (collective over the learner
        ranks: `Learner.logprobs`)."""
        from moe_rl.batch import TokenBatch

        tokens = TokenBatch.from_lists(self.prompts, self.responses, pad_id=self.pad_id,
                                       seq_multiple=self.seq_multiple)
        logp_BT = learner.logprobs(tokens, temperature=1.0)
        return SyncCheck(version, [logp_BT[b, :len(r)].tolist() for b, r in enumerate(self.responses)])

    def engine_side(self, engine: Any, rank: int, check: SyncCheck, expected: dict[str, int],
                    raw: dict[str, int]) -> SyncVerdict:
        """Score the probe on `engine` and compare with `check`. With checksums (the
        transformers sampler): `expected`, what the engine should hold by the tensors it was
        handed (`expected_checksums`), against what it holds (`held_tensor`); `raw`, what it
        was handed, against the learner's export (`check.sums`, sent under the separate
        placement)."""
        t0 = time.perf_counter()
        got = engine.score(self.prompts, self.responses, temperature=1.0)
        diffs = [abs(a - b) for g, w in zip(got, check.logp) for a, b in zip(g, w)] or [0.0]
        bad = [n for n, s in expected.items() if tensor_checksum(engine.held_tensor(n)) != s]
        bad += [n for n, s in check.sums.items() if raw.get(n) != s]
        precision = str(getattr(engine, "precision", "fp32"))
        return SyncVerdict(rank, check.version, float(max(diffs)), TOLERANCE.get(precision, TOLERANCE["bf16"]),
                           time.perf_counter() - t0, sorted(set(bad)), float(sum(diffs) / len(diffs)),
                           MEAN_TOLERANCE.get(precision, MEAN_TOLERANCE["bf16"]))


def attach_verifier(collector: Any, every: int, seed: int, backend: str) -> None:
    """The run's check after every `every`-th push (0: none) on `collector`'s weight
    transport: its probe from a few of the task's prompts drawn from `seed` alone, tensor
    checksums too for the transformers sampler (`backend`), whose engines hold plain
    parameters. Every rank, once, after the collector exists."""
    if not every:
        return
    problems = collector.task.sample(PROBE_ROWS, np.random.default_rng([seed, 65]))
    prompts, responses = probe_batch([collector.prompts.encode(p) for p in problems], seed)
    collector.weight_sync.verifier = SyncVerifier(every, prompts, responses, hashes=backend == "transformers",
                                                  seq_multiple=collector.tp, pad_id=collector.pad_id)
