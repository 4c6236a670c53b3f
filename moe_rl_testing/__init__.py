"""What the tests (tests/) and the benchmarks (bench/) share: fixtures that build models and
batches, launchers for torchrun workers and whole programs, independent reference
computations, and the benchmarks' result writer. Importable wherever moe_rl is (it is a
package of the same checkout, `setup.py`); never imports tests/ or bench/.

    moe_rl_testing.ROOT            the checkout's root (examples/, tools/, bench/results/)
    moe_rl_testing.bench_common    timing, the machine and versions, bench/results/ writer
    moe_rl_testing.workers/        scripts the tests run under torchrun or as a child process
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The checkout's root: the folder holding moe_rl/, examples/, tools/, tests/ and bench/."""
