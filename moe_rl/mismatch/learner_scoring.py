"""Score sampled responses with the megatron learner at a given precision and layout.

    results = score_in_process(ckpt, ScoringLayout(), jobs, temperature=1.0)
    results = score_with_torchrun(ckpt, ScoringLayout(ep=2), jobs, 1.0, work_dir)

A one-process layout runs in the calling process. A larger one runs under torchrun
(`python -m torch.distributed.run ... -m moe_rl.mismatch.learner_scoring JOB_DIR`):
every rank reads the same job file, the ranks score it together, and rank 0 writes the
results next to it. Launching workers per layout (rather than running the whole tool under
torchrun) lets one report hold a one-process learner and an EP=2 learner scoring the very
same rollouts, and keeps the sampler out of the learner's process group.

Routing: with `capture_routing`, each rank's record (its data-parallel rows, its pipeline
stage's MoE layers) is gathered to rank 0 as `[B, S, L_moe, K]` top-k ids, the router's own
choice at every position.

megatron is imported inside functions only (moe_rl.learner is the package that imports it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from moe_rl.batch import TokenBatch
from moe_rl.config import config_from_dict, to_dict
from moe_rl.mismatch.settings import MeasureError, ScoringLayout
from moe_rl.mismatch.sources import Checkpoint
from moe_rl.runtime.collectives import all_gather_object

if TYPE_CHECKING:
    from moe_rl.config.model import ParamsDtype

log = logging.getLogger(__name__)

JOB_FILE = "job.pt"
RESULT_FILE = "result.pt"
LOG_FILE = "worker.log"


@dataclass(frozen=True)
class ScoreJob:
    """One sampler's rollouts to score with a learner of one precision."""

    sampler: str  # "vllm:bf16": results are keyed by (sampler, learner_precision)
    learner_precision: str
    batch: TokenBatch
    capture_routing: bool


@dataclass(frozen=True)
class Scored:
    logp_BT: torch.Tensor  # [B, T] fp32, 0 where there is no response token
    ids_BSLK: torch.Tensor | None  # [B, S, L_moe, K] the learner's top-k per position


def _load_weights(learner, ckpt: Checkpoint) -> None:
    from moe_rl.learner import load_checkpoint
    from moe_rl.learner.hf_import import load_hf_weights

    if ckpt.kind == "hf":
        load_hf_weights(learner, ckpt.path)
    else:
        load_checkpoint(learner, ckpt.path, load_optimizer=False)


def _gather_routing(record, B: int, S: int, num_moe_layers: int) -> torch.Tensor | None:
    """Every rank's record -> `[B, S, L_moe, K]` on rank 0 (None elsewhere). Collective."""
    import torch.distributed as dist

    mine = (record.rows.cpu(), list(record.layers), record.own_ids_RSLK[:, :S].cpu())  # records may sit on the GPU
    parts = all_gather_object(mine)  # B*S*L*K uint8s: small for a diagnostic batch
    if dist.get_rank() != 0:
        return None
    K = record.own_ids_RSLK.shape[-1]
    ids = torch.zeros(B, S, num_moe_layers, K, dtype=record.own_ids_RSLK.dtype)
    for rows, layers, ids_RSLK in parts:  # TP ranks hold identical copies: overwriting is fine
        for j, layer in enumerate(layers):
            ids[rows, :, layer] = ids_RSLK[:, :, j]
    return ids


def score_jobs(ckpt: Checkpoint, layout: ScoringLayout, jobs: list[ScoreJob], temperature: float,
               progress=None) -> dict[tuple[str, str], Scored]:
    """Collective over the current world: build a learner per precision, score every job.
    Returns {(sampler, learner_precision): Scored} on rank 0, {} on the other ranks."""
    import torch.distributed as dist

    from moe_rl.learner import Learner, RoutingPlan, init_distributed, parallel_layout

    rank, world = init_distributed(ckpt.cfg.parallel.distributed_backend)
    if world != layout.nproc:
        raise RuntimeError(f"layout {layout.name} needs {layout.nproc} processes, the world has {world}")
    cfg = dataclasses.replace(ckpt.cfg, parallel=layout.parallel_config(ckpt.cfg.parallel))
    m = cfg.model
    out: dict[tuple[str, str], Scored] = {}
    precisions = list(dict.fromkeys(j.learner_precision for j in jobs))
    with parallel_layout(cfg.parallel, seed=cfg.run.seed) as lay:
        for precision in precisions:
            dtype = cast("ParamsDtype", precision)  # (one of LEARNER_PRECISIONS: Setting's check)
            learner = Learner(dataclasses.replace(m, params_dtype=dtype), cfg.parallel, lay)
            _load_weights(learner, ckpt)
            for job in (j for j in jobs if j.learner_precision == precision):
                res = learner.score_whole(job.batch, temperature, RoutingPlan(capture=job.capture_routing))
                ids = None
                if job.capture_routing and res.record is not None:
                    ids = _gather_routing(res.record, job.batch.batch_size, job.batch.seq_len,
                                          learner.taps.num_moe_layers)
                if rank == 0:
                    out[(job.sampler, precision)] = Scored(res.logp_BT, ids)
                if progress is not None:
                    progress(f"learner {precision}@{layout.name} scored {job.sampler}")
            del learner
        dist.barrier()
    return out


def score_in_process(ckpt: Checkpoint, layout: ScoringLayout, jobs: list[ScoreJob], temperature: float,
                     progress=None) -> dict[tuple[str, str], Scored]:
    """A one-process layout, in this process (a one-process gloo world is made if needed)."""
    if layout.nproc != 1:
        raise ValueError(f"layout {layout.name} needs {layout.nproc} processes; use score_with_torchrun")
    return score_jobs(ckpt, layout, jobs, temperature, progress)


# --------------------------------------------------------------------------- torchrun


def _job_dict(ckpt: Checkpoint, layout: ScoringLayout, jobs: list[ScoreJob], temperature: float) -> dict:
    return {
        "checkpoint": {"path": str(ckpt.path), "kind": ckpt.kind, "cfg": to_dict(ckpt.cfg)},
        "layout": dataclasses.asdict(layout),
        "temperature": float(temperature),
        "jobs": [
            {
                "sampler": j.sampler,
                "learner_precision": j.learner_precision,
                "tokens_BS": j.batch.tokens_BS,
                "prompt_lens_B": j.batch.prompt_lens_B,
                "response_lens_B": j.batch.response_lens_B,
                "response_width": j.batch.response_width,
                "capture_routing": j.capture_routing,
            }
            for j in jobs
        ],
    }


def _jobs_from_dict(d: dict) -> tuple[Checkpoint, ScoringLayout, list[ScoreJob], float]:
    c = d["checkpoint"]
    ckpt = Checkpoint(Path(c["path"]), c["kind"], config_from_dict(c["cfg"]))
    jobs = [
        ScoreJob(
            j["sampler"],
            j["learner_precision"],
            TokenBatch(j["tokens_BS"], j["prompt_lens_B"], j["response_lens_B"], j["response_width"]),
            j["capture_routing"],
        )
        for j in d["jobs"]
    ]
    return ckpt, ScoringLayout(**d["layout"]), jobs, d["temperature"]


def score_with_torchrun(ckpt: Checkpoint, layout: ScoringLayout, jobs: list[ScoreJob], temperature: float,
                        work_dir: Path) -> dict[tuple[str, str], Scored]:
    """Run `score_jobs` in `layout.nproc` torchrun workers (gloo on CPU); their output goes
    to `work_dir/worker.log`, whose tail is in the error if they fail."""
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.save(_job_dict(ckpt, layout, jobs, temperature), work_dir / JOB_FILE)
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding moe_rl/
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={layout.nproc}",
           "-m", "moe_rl.mismatch.learner_scoring", str(work_dir)]
    with open(work_dir / LOG_FILE, "w") as logf:
        proc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0 or not (work_dir / RESULT_FILE).is_file():
        tail = "\n".join((work_dir / LOG_FILE).read_text(errors="replace").splitlines()[-40:])
        raise MeasureError(f"the learner at layout {layout.name} ({layout.nproc} processes) failed "
                           f"(exit {proc.returncode}):\n{tail}")
    saved = torch.load(work_dir / RESULT_FILE, weights_only=True)
    return {(r["sampler"], r["learner_precision"]): Scored(r["logp_BT"], r["ids_BSLK"]) for r in saved}


def worker_main(job_dir: str) -> None:
    """One torchrun rank: score the job in `job_dir`; rank 0 writes the result file."""
    from moe_rl.cli import cpu_environment, setup_logging

    cpu_environment()
    d = torch.load(Path(job_dir) / JOB_FILE, weights_only=True)
    ckpt, layout, jobs, temperature = _jobs_from_dict(d)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    results = score_jobs(ckpt, layout, jobs, temperature, progress=log.info if rank == 0 else None)
    if rank == 0:
        rows = [{"sampler": s, "learner_precision": p, "logp_BT": r.logp_BT, "ids_BSLK": r.ids_BSLK}
                for (s, p), r in results.items()]
        tmp = Path(job_dir) / f".{RESULT_FILE}.tmp"
        torch.save(rows, tmp)
        os.replace(tmp, Path(job_dir) / RESULT_FILE)  # the parent never reads half a file
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: torchrun ... -m moe_rl.mismatch.learner_scoring JOB_DIR")
    worker_main(sys.argv[1])
