"""Known-harmless third-party warnings are hidden by their exact text; anything else shows."""

import logging
import warnings

import pytest

from moe_rl.runtime import noise


@pytest.fixture
def silenced(monkeypatch):
    """silence_known_noise() inside a fresh warnings state, undone afterwards."""
    monkeypatch.delenv(noise.SHOW_ALL_ENV, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        noise.silence_known_noise()
        yield caught
        noise.show_third_party_warnings()
    monkeypatch.delenv(noise.SHOW_ALL_ENV, raising=False)


def test_a_known_warning_is_hidden_and_an_unknown_one_shows(silenced):
    warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
    warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                  UserWarning, stacklevel=1)
    # same library, same category, different text: a real warning, shown
    warnings.warn("Apex is not installed and your model is wrong", UserWarning, stacklevel=1)
    warnings.warn("`load_state_dict` is deprecated and will be removed in future versions. Please use `load`",
                  FutureWarning, stacklevel=1)
    assert [str(w.message) for w in silenced] == ["Apex is not installed and your model is wrong"]


def test_verbose_shows_them_again(silenced):
    noise.show_third_party_warnings()
    warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
    assert [str(w.message) for w in silenced] == ["Apex is not installed. Falling back to Torch Norm"]


def test_a_known_log_line_is_dropped_only_from_its_logger(silenced, caplog):
    caplog.set_level(logging.WARNING)
    logging.getLogger("megatron.core.rerun_state_machine").warning(
        "RerunStateMachine initialized in mode RerunMode.DISABLED")
    logging.getLogger("megatron.core.rerun_state_machine").warning("RerunStateMachine found a NaN")
    logging.getLogger("torch._library.triton").warning("Triton not available, find_triton_kernels = []")
    logging.getLogger("some.other").warning("Triton not available, find_triton_kernels = []")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("megatron.core.rerun_state_machine", "RerunStateMachine found a NaN"),
        ("some.other", "Triton not available, find_triton_kernels = []")]


def test_the_environment_switch_keeps_everything(monkeypatch):
    monkeypatch.setenv(noise.SHOW_ALL_ENV, "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        noise.silence_known_noise()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
    assert len(caught) == 1
