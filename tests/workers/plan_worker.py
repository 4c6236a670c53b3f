"""Worker for tests/test_plan.py: the planner for a list of jobs, in one process (the
meta-device build joins a fake process group, so it runs outside pytest's process).

    python tests/workers/plan_worker.py JOBS.json OUT.json

Each job: {"name", "recipe" (path or null), "overrides": [...], "gpus", "hardware": {...},
"suggest": bool}. OUT.json maps name -> the `--json` object, or {"error": message}.
"""

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
    plan = make_plan(source, hw, prompt_tokens=prompt_tokens_for(source.cfg, job.get("prompt_tokens", 1024)))
    return plan_dict(plan, suggest(plan) if job.get("suggest") else [])


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    out = {}
    for job in jobs:
        try:
            out[job["name"]] = run(job)
        except ConfigError as e:
            out[job["name"]] = {"error": str(e)}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main()
