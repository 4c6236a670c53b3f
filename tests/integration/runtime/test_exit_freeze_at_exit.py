"""`skip_final_collections` at a real interpreter exit: every object alive then (a cycle made
before the exit included) is frozen before the interpreter's last collections, and the
handlers registered before it still run."""

from __future__ import annotations

import subprocess
import sys

from moe_rl_testing import ROOT

CODE = """
import atexit, gc
from moe_rl.runtime.manual_gc import skip_final_collections
cycle = []
cycle.append(cycle)
def report():  # registered first: runs after the freeze (atexit runs handlers last-in first-out)
    print(gc.get_freeze_count() > 1000, any(o is cycle for o in gc.get_objects()))
atexit.register(report)
skip_final_collections()
print(gc.get_freeze_count())
"""


def test_the_objects_alive_at_exit_are_frozen_before_the_last_collections():
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before_exit, at_exit = proc.stdout.strip().splitlines()[-2:]
    assert before_exit == "0" and at_exit == "True False"
