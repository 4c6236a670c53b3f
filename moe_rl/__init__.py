"""moe_rl: RL post-training for Mixture-of-Experts models on megatron-core.

Subpackages own one idea each (docs/architecture.md): objectives, advantages, routing,
learner (the only importer of megatron.core), sampler (the only importer of vllm),
convert, diagnostics, tasks; the programs (programs/) and the one run loop (loop/).

Importing `moe_rl` imports `moe_rl.objectives` and `moe_rl.advantages` (and so torch,
nothing heavier): the objectives register their hyperparameter types and the advantage
estimators their kinds into the config package, and doing it here makes "every objective
and estimator is registered" hold for every Config built anywhere (a recipe, a
run's config.yaml, a test), whatever was imported first. Every program that builds a
Config imports torch anyway; megatron and vLLM stay lazy.
"""

import moe_rl.advantages
import moe_rl.objectives  # noqa: F401  (registers the objectives' hyperparameters into moe_rl.config)

__version__ = "0.1.0"
