"""`python -m moe_rl_testing.worker_main SCRIPT [ARGS...]`: run a test worker script as
`python SCRIPT ARGS...` would (its folder first on sys.path, `__name__ == "__main__"`), then
skip the interpreter's exit-time collections (`moe_rl.runtime.manual_gc`): 1-3 s per rank
that a test launching dozens of worker processes would otherwise wait through."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from moe_rl.runtime.manual_gc import skip_final_collections


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")
    skip_final_collections()


if __name__ == "__main__":
    main()
