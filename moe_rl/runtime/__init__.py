"""What every part of a run leans on, knowing nothing of programs, models or engines:

    atomic        write a file whole or not at all (temp file, fsync, rename)
    collectives   object collectives over the current world (gather, broadcast, all-to-all)
    worlds        the process groups of a separate placement: the bridge of all ranks
    failures      which error a failure really is (a full disk, a killed rank), in one line
    noise         the third-party warnings known to be harmless, silenced by exact text
    registry      the name -> entry registry of the objective and advantage families
    timing        a step's phases and their seconds (StepTimer)
    metrics       combining per-update metric dicts into a step's (means, sums, maxima)
    wandb_log     the run's Weights & Biases run (logging.wandb): open, log a step, finish
"""
