"""Known-harmless third-party warnings, silenced by their exact text.

A CPU run used to open with a screenful of warnings from megatron, torch and vLLM that a
user of this package can do nothing about. `HARMLESS` lists each one: the regex its text
starts with, where it comes from (the `warnings` module, or the logger that logs it), and
why it is harmless. Anything not listed still shows, including new warnings from the same
libraries. MOE_RL_WARNINGS=1 (or `--verbose`) shows everything.

    silence_known_noise()          # cli.cpu_environment does this at every start

Not silenced because it cannot be from Python: vLLM's CPU worker prints
`Warning: NUMA binding: Using MEMBIND policy ...` from C++ straight to stderr.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import NamedTuple

SHOW_ALL_ENV = "MOE_RL_WARNINGS"
WARNINGS_MODULE = "warnings"


class Noise(NamedTuple):
    """One known-harmless message."""

    source: str
    """"warnings" (a warnings.warn call) or the name of the logger that logs it."""
    text: str
    """Regex matched at the start of the message."""


HARMLESS: tuple[Noise, ...] = (
    # megatron-core at import without Transformer Engine / Apex (every CPU machine): it says
    # it uses its plain-torch fallbacks, which is what the CPU path is built on.
    Noise(WARNINGS_MODULE, r"Transformer Engine and Apex are not installed\. Falling back to "),
    Noise(WARNINGS_MODULE, r"Apex is not installed\. Falling back to Torch Norm"),
    # megatron's TransformerConfig converts its own default cuda_graph_scope="full"; no CUDA
    # graphs are captured by this package.
    Noise(WARNINGS_MODULE, r"full scope is deprecated\. Use empty cuda_graph_scope"),
    # megatron's dist_checkpointing calls torch DCP's older API (torch.distributed.checkpoint
    # load_state_dict, ShardedTensor): deprecations inside megatron, the files are the same.
    Noise(WARNINGS_MODULE, r"`load_state_dict` is deprecated and will be removed in future versions"),
    Noise(WARNINGS_MODULE, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    # vLLM's Triton dispatcher scans torch.distributed's attributes and so touches the
    # deprecated alias reduce_op; nothing calls it.
    Noise(WARNINGS_MODULE, r"`torch\.distributed\.reduce_op` is deprecated"),
    # megatron logs at WARNING that its fault-tolerance rerun machinery is off (it is never
    # used here).
    Noise("megatron.core.rerun_state_machine", r"RerunStateMachine initialized in mode RerunMode\.DISABLED"),
    # torch looks for Triton kernels in custom ops; a CPU machine has no Triton, none to find.
    Noise("torch._library.triton", r"Triton not available, find_triton_kernels = \[\]"),
)
"""The known-harmless messages (the comments say what each is and why it is harmless)."""


class _DropKnownNoise(logging.Filter):
    """Drops a logger's records whose message is one of its HARMLESS texts."""

    def __init__(self, logger: str) -> None:
        super().__init__()
        self.texts = [re.compile(n.text) for n in HARMLESS if n.source == logger]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(t.match(message) for t in self.texts)


_LOG_FILTERS = {n.source: _DropKnownNoise(n.source) for n in HARMLESS if n.source != WARNINGS_MODULE}
_WARNING_FILTERS: list[tuple] = []


def silence_known_noise() -> None:
    """Hide the HARMLESS messages in this process (idempotent); nothing when
    MOE_RL_WARNINGS=1."""
    if os.environ.get(SHOW_ALL_ENV) == "1":
        return
    for noise in HARMLESS:
        if noise.source == WARNINGS_MODULE:
            warnings.filterwarnings("ignore", message=noise.text)
            if warnings.filters[0] not in _WARNING_FILTERS:
                _WARNING_FILTERS.append(warnings.filters[0])
    for logger, drop in _LOG_FILTERS.items():
        logging.getLogger(logger).addFilter(drop)


def show_third_party_warnings() -> None:
    """Undo `silence_known_noise`, here and in the processes this one starts (`--verbose`)."""
    os.environ[SHOW_ALL_ENV] = "1"
    warnings.filters[:] = [f for f in warnings.filters if f not in _WARNING_FILTERS]  # type: ignore[index]  # (typeshed: a Sequence; a list at runtime)
    _WARNING_FILTERS.clear()
    refresh = getattr(warnings, "_filters_mutated", None)  # drop the "already filtered" caches
    if refresh is not None:
        refresh()
    for logger, drop in _LOG_FILTERS.items():
        logging.getLogger(logger).removeFilter(drop)
