"""The one run loop every program runs in (`run_loop.RunLoop`), the program interface
(`program.Program`), the run directory's files (`rundir`) and the agreed stop on
SIGINT / SIGTERM (`interrupt`)."""

from moe_rl.loop.program import Program
from moe_rl.loop.run_loop import RunLoop

__all__ = ["Program", "RunLoop"]
