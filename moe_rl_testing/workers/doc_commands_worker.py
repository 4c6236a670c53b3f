"""Worker for tests/integration/docs/test_docs_commands.py (and test_deepseek_v3.py's convert round trip):
`python -m MODULE ARGS` and `python tools/SCRIPT.py ARGS` command lines, each by its
program's own `main(argv)`, one after another in this one process (started from the
repository root with the venv first on PATH, as the commands are run), instead of one
interpreter start-up (torch, megatron) per command.

    python moe_rl_testing/workers/doc_commands_worker.py JOBS.json OUT.json

Each job: {"where", "program" (a module or a script path), "argv" (its arguments), "env"
(variables set for it alone)}. OUT.json maps where -> {"status", "stdout", "stderr"}: the
exit status the command line would have had (main's return value or SystemExit's code; 1
with the traceback on an uncaught exception, as python exits) and what it printed.
"""

import contextlib
import importlib
import importlib.util
import io
import json
import os
import sys
import traceback
from pathlib import Path


def _load(program: str):
    """The module `python -m program` / `python program` runs (a package's __main__)."""
    if not program.endswith(".py"):
        spec = importlib.util.find_spec(program)
        return importlib.import_module(program + ".__main__" if spec.submodule_search_locations else program)
    path = Path(program).resolve()
    spec = importlib.util.spec_from_file_location(f"doc_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # as `python path/script.py` puts its folder first
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): printed, status 1
    return 1


def run(job: dict) -> dict:
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_argv = dict(os.environ), sys.argv
    os.environ.update(job["env"])
    sys.argv = [job["program"], *job["argv"]]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = _exit_status(_load(job["program"]).main(job["argv"]))
            except SystemExit as e:  # argparse's --help and errors, mains that sys.exit
                status = _exit_status(e.code)
            except BaseException:  # what python would print before exiting 1
                traceback.print_exc()
                status = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    jobs, results = json.loads(Path(sys.argv[1]).read_text()), {}
    for job in jobs:  # written after each: a crash still reports the commands before it
        results[job["where"]] = run(job)
        Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
