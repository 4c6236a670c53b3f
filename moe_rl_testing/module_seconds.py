"""`python -m moe_rl_testing.module_seconds JUNIT_XML`: rewrite tests/module_seconds.json (the
order `make test`'s workers take modules in, tests/conftest.py) from a `make test` run's JUnit
report, e.g. `make test PYTEST_ARGS=--junitxml=/tmp/junit.xml`. Every module of at least
`--min` seconds is listed, by file name, with its measured seconds (setup and calls summed);
the machine and date go into the file's `_about`."""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import xml.etree.ElementTree as ET
from pathlib import Path

from moe_rl_testing import ROOT

OUT = ROOT / "tests" / "module_seconds.json"


def module_seconds(junit: Path) -> dict[str, float]:
    """Seconds per test module (its file name without .py) in a JUnit report."""
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # (a test class adds its name after the module's)
        module = next((p for p in reversed(parts) if p.startswith("test_")), parts[-1])
        seconds[module] += float(case.get("time", 0.0))
    return dict(seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moe_rl_testing.module_seconds", description=__doc__)
    parser.add_argument("junit", type=Path, help="a make test run's --junitxml report")
    parser.add_argument("--min", type=float, default=5.0, help="smallest module listed (seconds)")
    args = parser.parse_args(argv)
    if not args.junit.is_file():
        raise SystemExit(f"python -m moe_rl_testing.module_seconds: error: no JUnit report at {args.junit}")
    seconds = module_seconds(args.junit)
    kept = {name: round(s) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]) if s >= args.min}
    about = (f"seconds per test module in a make test run ({os.cpu_count()} CPUs, {platform.machine()}, "
             f"{datetime.date.today()}; python -m moe_rl_testing.module_seconds JUNIT): the order make test's "
             "workers take modules in (tests/conftest.py); modules not listed go last")
    tmp = OUT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"_about": about, **kept}, indent=1) + "\n")
    tmp.replace(OUT)
    print(f"{OUT.relative_to(ROOT)}: {len(kept)} modules of {len(seconds)}")


if __name__ == "__main__":
    main()
