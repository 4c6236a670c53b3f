"""moe_rl: RL post-training for Mixture-of-Experts models on megatron-core.

Subpackages own one idea each (see DESIGN in README): objectives, advantages, routing,
learner (the only importer of megatron.core), sampler (the only importer of vllm),
convert, diagnostics, tasks, and the loop in trainer.py. Importing `moe_rl` itself is
cheap: nothing heavy is imported here.
"""

__version__ = "0.1.0"
