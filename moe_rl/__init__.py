"""moe_rl: RL post-training for Mixture-of-Experts models on megatron-core.

Subpackages own one idea each (see DESIGN in README): objectives, advantages, routing,
learner (the only importer of megatron.core), sampler (the only importer of vllm),
convert, diagnostics, tasks, and the loop in trainer.py.

Importing `moe_rl` imports `moe_rl.objectives` (and so torch, nothing heavier): the
objectives register their hyperparameter types into the config package, and doing it here
makes "every objective is registered" hold for every Config built anywhere (a recipe, a
run's config.yaml, a test), whatever was imported first. Every program that builds a
Config imports torch anyway; megatron and vLLM stay lazy.
"""

import os

# libgomp (torch's OpenMP on CPU) cuts its workers' spin-wait to almost nothing once a
# process holds more OpenMP threads than CPUs, and megatron's checkpoint save leaves one
# more OpenMP team behind in the process: from the first save on, every parallel region of
# a CPU learner paid a futex wake-up, and its steps took twice as long (tiny_grpo: update
# 0.40 s -> 0.80 s). ACTIVE with libgomp's usual spin count keeps that spin in every case;
# it must be set before torch loads OpenMP. A user's own setting of either wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = "300000"

import moe_rl.objectives  # noqa: F401  (registers the objectives' hyperparameters into moe_rl.config)

__version__ = "0.1.0"
