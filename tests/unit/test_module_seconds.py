"""tests/module_seconds.json's generator reads a JUnit report: seconds summed per module file,
a test class counted in its module."""

from __future__ import annotations

from moe_rl_testing.module_seconds import module_seconds

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.integration.rollout.test_async" name="test_a" time="1.5"/>
<testcase classname="tests.integration.rollout.test_async" name="test_b" time="2.25"/>
<testcase classname="tests.unit.test_layout.TestRules" name="test_c" time="0.5"/>
<testcase classname="tests.unit.test_layout" name="test_d" time="0.25"/>
</testsuite></testsuites>"""


def test_seconds_are_summed_per_module_file(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    assert module_seconds(tmp_path / "junit.xml") == {"test_async": 3.75, "test_layout": 0.75}
