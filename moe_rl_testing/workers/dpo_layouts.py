"""Worker for tests/integration/test_dpo.py's layout test (run under torchrun).

One launch of 2 processes (`dist_helpers.one_process_then_world`):
reference (rank 0 alone, a one-process world): a fresh tiny MoE -> checkpoint `ckpt0`; the
    sequence log-probs of 6 preference pairs (12 rows) of the shipped held-out file, one DPO
    update (the surrogate, against fixed reference log-probs), the full parameters and
    log-probs after.
layouts (2 processes): the same at TP2, EP2 (data parallel 2: a pair's rows on different
    ranks) and PP2, from `ckpt0`. Results go to <out>/reference.pt and <out>/layouts.pt.
"""

import sys
from pathlib import Path

import torch

from moe_rl.config import load_config, to_dict
from moe_rl.learner.parallel import parallel_layout
from moe_rl_testing.dist_helpers import one_process_then_world

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "ep2": ["parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
}
# (as moe_rl_testing/workers/learner_layouts.py: a larger Adam eps keeps the first step a smooth
# function of the gradient, so layouts are compared on the math, not on sign noise at 0)
BASE = ["parallel.micro_batch_size=4", "optimizer.lr=1e-2", "optimizer.adam_eps=1e-3", "optimizer.clip_grad=0.5"]


def pairs_batch(tp: int):
    from moe_rl.programs.preference.data import encode_pairs, load_pairs
    from moe_rl.tasks.tokenizer import load_sentencepiece
    from moe_rl.tokenization import PromptEncoder

    encoder = PromptEncoder.from_config(load_config(None).task, load_sentencepiece())
    return encode_pairs(load_pairs(ROOT / "moe_rl" / "assets" / "preferences" / "reverse_prefs_eval.jsonl")[:6], encoder, tp)


def dpo_step(learner, tokens) -> dict:
    from moe_rl.learner.gather import iter_full_tensors
    from moe_rl.programs.dpo.loss import PairLogps, pair_metrics
    from moe_rl.programs.dpo.program import sequence_logps
    from moe_rl.programs.dpo.surrogate import COEF_KEY, surrogate_coefficients, surrogate_loss
    from moe_rl.programs.preference.data import pair_rows

    logp_BT = learner.logprobs(tokens)
    ref_B = torch.linspace(-30, -10, tokens.batch_size, dtype=torch.float64)
    seq = sequence_logps(learner, tokens)
    logps = PairLogps(*pair_rows(seq), *pair_rows(ref_B))
    coef = surrogate_coefficients(logps.margin(), 0.5, "sigmoid")
    update = learner.train_step(tokens, surrogate_loss, extras={COEF_KEY: coef})
    return {"logp": logp_BT, "seq": seq, "metrics": pair_metrics(logps, 0.5, "sigmoid"),
            "grad_norm": update["grad_norm"], "params": dict(iter_full_tensors(learner.gpt)),
            "seq_after": sequence_logps(learner, tokens)}


def run(mode: str, out: str) -> dict:
    from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl_testing.learner_utils import learner_of

    result = {}
    for name, overrides in ({"reference": []} if mode == "reference" else LAYOUTS).items():
        cfg = load_config(None, BASE + overrides)
        with parallel_layout(cfg.parallel, seed=3) as layout:
            learner = learner_of(cfg, layout)
            if mode == "reference":
                save_checkpoint(learner, f"{out}/ckpt0", recipe=to_dict(cfg))
            else:
                load_checkpoint(learner, f"{out}/ckpt0")
            result[name] = dpo_step(learner, pairs_batch(layout.tp))
    return result


def main() -> None:
    out = sys.argv[1]
    one_process_then_world(out, lambda: run("reference", out), lambda: run("layouts", out), world_size=2)


if __name__ == "__main__":
    main()
