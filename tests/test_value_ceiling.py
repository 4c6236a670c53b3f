"""tools/value_ceiling.py: the best possible value under an exact-match reward, by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("value_ceiling", ROOT / "tools" / "value_ceiling.py")
value_ceiling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(value_ceiling)

ANSWER = [5, 7, 9, 2]        # three answer tokens and EOS (2)
P = [0.5, 0.8, 0.9, 0.6]     # the policy's teacher-forced probability of each


def test_on_track_the_value_is_the_product_of_the_probabilities_still_to_come() -> None:
    values = value_ceiling.exact_values(ANSWER, P, ANSWER)
    expected = [0.5 * 0.8 * 0.9 * 0.6, 0.8 * 0.9 * 0.6, 0.9 * 0.6, 0.6]
    assert values == pytest.approx(expected, abs=1e-12)


def test_the_value_is_zero_from_the_state_after_the_first_wrong_token() -> None:
    # the second token is wrong: the state before it still has the on-track value
    values = value_ceiling.exact_values(ANSWER, P, [5, 3, 9, 2, 4])
    assert values == pytest.approx([0.5 * 0.8 * 0.9 * 0.6, 0.8 * 0.9 * 0.6, 0.0, 0.0, 0.0], abs=1e-12)
    # a response that runs on past the answer's EOS position is off track there
    assert value_ceiling.exact_values([2], [0.7], [4, 4]) == pytest.approx([0.7, 0.0])


def test_a_bad_count_or_directory_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    assert value_ceiling.main(["--policy", str(tmp_path), "--prompts", "0"]) == 2
    assert capsys.readouterr().err.strip() == "value_ceiling: --prompts must be at least 1, got 0"
    assert value_ceiling.main(["--policy", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is not a Hugging Face directory (no config.json)" in err
