"""Batches sampled ahead (asynchronous rollout), kept on disk so a resumed run continues the
same schedule.

Under `rl.max_staleness=k` the engines keep a queue of k batches: during step n they sample
step n+k with step n-1's weights. When the run stops after step n, batches n+1 .. n+k
already exist and their weights are in no checkpoint, so they are saved rather than
re-generated: each engine leader writes its groups and the step's decisions to
`<run>/sampled_ahead/step_<m>.engine<e>.json` (plain JSON: nothing in it executes on load)
as soon as it has sampled batch m, before it takes the next weights, hence before the
learners' checkpoint of that step exists. A resume from step n loads it when every engine
finds its share saved under the same engine layout (a resume may change the number of
engines or their size, and each file holds one engine's block of the prompts); otherwise
every engine re-samples with the checkpoint's weights, and the log says why and that the
schedule differs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moe_rl.rollout.types import GroupSummary, Sampled, ScoredGroup
from moe_rl.runtime.atomic import atomic_write_text
from moe_rl.runtime.collectives import Group

if TYPE_CHECKING:
    from moe_rl.rollout.placement import EnginePlacement

log = logging.getLogger(__name__)

KEEP = 3
"""Files per engine kept (the newest; at least rl.max_staleness + 1, the batches queued
ahead under k); older ones are deleted as new ones are written."""


def _path(run_dir: Path, step: int, engine: int) -> Path:
    return run_dir / "sampled_ahead" / f"step_{step:06d}.engine{engine}.json"


def _summary(s: dict) -> GroupSummary:
    runs = tuple(tuple((v, n) for v, n in r) for r in s["version_runs"]) if s.get("version_runs") else None
    episodes = tuple(tuple(t) for t in s["episodes"]) if s.get("episodes") is not None else None
    return GroupSummary(s["prompt_len"], tuple(s["response_lens"]), tuple(s["rewards"]), tuple(s["finish"]),
                        s["version"], runs, tuple(s["carried"]) if s.get("carried") else None, episodes,
                        tuple(s["episode_of"]) if s.get("episode_of") is not None else None)


def save_ahead(run_dir: Path, engine: int, layout: tuple[int, int], sampled: Sampled, keep: int = KEEP) -> None:
    """Write this engine leader's share of a batch sampled ahead (atomic), and prune to the
    newest `keep`. `layout`: (engines, ranks per engine) it was sampled under."""
    groups = [{"key": list(k), "prompt": g.prompt, "responses": g.responses, "logprobs": g.logprobs,
               "texts": g.texts, "rewards": g.rewards, "finish": g.finish, "version": g.version,
               "token_versions": g.token_versions, "carried": g.carried, "observed": g.observed,
               "episodes": g.episodes, "episode_of": g.episode_of,
               "routed": [np.asarray(r).tolist() for r in g.routed] if g.routed is not None else None}
              for k, g in sampled.held.items()]
    doc = {"step": sampled.step, "layout": list(layout), "version": sampled.version, "kept": sampled.kept,
           "drawn": [[vars(s) for s in d] for d in sampled.drawn], "engine_seconds": sampled.engine_seconds,
           "dropped_stale": sampled.dropped_stale, "reward_timeouts": sampled.reward_timeouts, "groups": groups}
    write_engine_file(_path(run_dir, sampled.step, engine), doc, engine, keep)


def write_engine_file(path: Path, doc: dict, engine: int, keep: int) -> None:
    """Write one engine's `step_<n>.engine<e>.json` document (atomic) and delete all but the
    newest `keep` of that engine's files beside it (batches sampled ahead, rollout pools)."""
    atomic_write_text(path, json.dumps(doc))
    for old in sorted(path.parent.glob(f"step_*.engine{engine}.json"))[:-keep]:
        old.unlink(missing_ok=True)


def read_engine_file(path: Path, layout: tuple[int, int]) -> tuple[dict | None, str]:
    """The document `write_engine_file` wrote at `path`, or None and why not: no file, one
    that cannot be read, or one written under another `layout` (engines, ranks per engine)."""
    if not path.is_file():
        return None, f"no {path.name}"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{path.name} cannot be read ({' '.join(str(e).split())})"
    saved = tuple(doc.get("layout") or ())
    if saved != tuple(layout):
        was = f"{saved[0]} engine(s) of {saved[1]} rank(s)" if len(saved) == 2 else "an unrecorded engine layout"
        return None, f"{path.name} was sampled by {was}, this run has {layout[0]} of {layout[1]}"
    return doc, ""


def load_ahead(run_dir: Path, step: int, engine: int, layout: tuple[int, int]) -> tuple[Sampled | None, str]:
    """This engine's share of the batch of `step` sampled ahead before a stop, or None and
    why not: no file, or one saved under another `layout` (engines, ranks per engine)."""
    doc, why = read_engine_file(_path(run_dir, step, engine), layout)
    if doc is None:
        return None, why
    out = Sampled(doc["step"], doc["version"], [tuple(k) for k in doc["kept"]],
                  [[_summary(s) for s in d] for d in doc["drawn"]], doc["engine_seconds"],
                  dropped_stale=doc.get("dropped_stale", 0), reward_timeouts=doc.get("reward_timeouts", 0))
    for g in doc["groups"]:
        routed = [np.asarray(r) for r in g["routed"]] if g["routed"] is not None else None
        out.held[tuple(g["key"])] = ScoredGroup(g["prompt"], g["responses"], g["logprobs"], g["texts"], g["rewards"],
                                                g["finish"], routed, g["version"], g.get("token_versions"),
                                                g.get("carried"), g.get("observed"),
                                                [tuple(t) for t in g["episodes"]] if g.get("episodes") else None,
                                                g.get("episode_of"))
    return out, ""


def engines_lacking(placement: EnginePlacement, group: Group, why: str) -> list[str]:
    """Every engine's reason ("engine e: why") for lacking a saved file it needs on a
    resume, this engine's being `why` ("": it has it), so that all engine ranks decide
    alike. Collective over the engine ranks (`group`: their process group)."""
    whys = placement.gather_engines(why, group)
    return [f"engine {e}: {w}" for e, w in enumerate(whys) if w]


def agreed_ahead(placement: EnginePlacement, group: Group, run_dir: Path, step: int) -> Sampled | None:
    """The batch of `step` the engines sampled ahead before a stop, when every engine finds
    its share saved under this engine layout; else None on every engine rank alike (then
    they all sample it now), the reason logged once. Collective over the engine ranks; a
    learner-only rank returns None at once. Only an engine's leader holds its groups, as
    when sampled."""
    p = placement
    if not p.hosts_engine:
        return None
    assert p.engine is not None  # (hosts an engine)
    saved, why = load_ahead(run_dir, step, p.engine, (p.engines, p.ranks_per_engine))
    missing = engines_lacking(p, group, why)
    if missing:
        if p.rank == p.first_engine_rank:
            log.warning("resuming step %d without the batch sampled ahead before the stop (%s): sampling it now "
                        "with the checkpoint's weights (the uninterrupted run used the step before's)", step,
                        "; ".join(missing))
        return None
    assert saved is not None  # (no engine lacks its share: this one's was read)
    if not p.leader:
        saved.held = {}
    return saved
