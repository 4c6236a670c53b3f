"""The mismatch tool: measure how far a sampler's log-probs are from the learner's on the
same tokens, for a checkpoint and a list of settings, and write the report.

An application over the libraries, like the trainer: it starts samplers (`moe_rl.sampler`)
and the megatron learner (`moe_rl.learner`), and hands their log-probs to the pure metrics
and report of `moe_rl.diagnostics`. The arrows run one way: nothing in the libraries
imports this package.

    settings.py         what one row compares: Setting, ScoringLayout, MeasureError
    sources.py          where weights and prompts come from, checked before any engine starts
    learner_scoring.py  the learner's scores, in this process or in torchrun workers
    run.py              prepare -> sample -> score -> compute_mismatch -> write_report

    from moe_rl.mismatch.run import MeasureConfig, run
    run(MeasureConfig(settings=(Setting.parse("vllm:bf16"),)), "runs/mismatch")

`tools/measure_mismatch.py` is the command line over `run`. Nothing is imported here, so
that a torchrun worker (`-m moe_rl.mismatch.learner_scoring`) loads only what it needs.
"""
