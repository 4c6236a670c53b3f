"""Worker for tests/integration/plan/test_plan.py: the planner for a list of jobs, in one process (the
meta-device build joins a fake process group, so it runs outside pytest's process).

    python moe_rl_testing/workers/plan_worker.py JOBS.json OUT.json

Each job: {"name", "recipe" (path or null), "overrides": [...], "gpus", "hardware": {...},
"suggest": bool}. OUT.json maps name -> the `--json` object, or {"error": message}.
A job {"name", "argv": [...]} is a `python -m moe_rl.plan ARGV` command line, run by the
CLI's own main(argv) here (one interpreter start-up for all of them): name -> {"returncode",
"stdout", "stderr"} (an exception escaping main fails the worker, as it would the command).
"""

import contextlib
import io
import json
import logging
import sys
import warnings

warnings.filterwarnings("ignore")
logging.getLogger("megatron").setLevel(logging.ERROR)

from moe_rl.config import ConfigError, load_config  # noqa: E402
from moe_rl.plan import Hardware, make_plan, resolve_model, suggest  # noqa: E402
from moe_rl.plan.report import plan_dict  # noqa: E402
from moe_rl.plan.workload import prompt_tokens_for  # noqa: E402


def run(job: dict) -> dict:
    source = resolve_model(load_config(job.get("recipe"), job.get("overrides", [])))
    hw = Hardware(gpus=job["gpus"], **job.get("hardware", {}))
    prompt_tokens = prompt_tokens_for(source.cfg.model, source.cfg.sampler, job.get("prompt_tokens", 1024))
    plan = make_plan(source, hw, prompt_tokens=prompt_tokens)
    return plan_dict(plan, suggest(plan) if job.get("suggest") else [])


def run_cli(argv: list[str]) -> dict:
    from moe_rl.plan.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    # warnings shown as the command line shows them (the CLI silences its own known noise)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("default")
        try:
            status = main(argv)
        except SystemExit as e:  # argparse
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
    return {"returncode": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    out = {}
    for job in jobs:
        if "argv" in job:
            out[job["name"]] = run_cli(job["argv"])
            continue
        try:
            out[job["name"]] = run(job)
        except ConfigError as e:
            out[job["name"]] = {"error": str(e)}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main()
