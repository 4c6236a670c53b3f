"""Which vLLM / megatron-core / Transformer Engine releases match a GPU machine's torch.

GPU machines keep their own torch (a CUDA build we must never replace), so every other
GPU package is pinned to the release built against that torch. Stdlib only: this runs
before anything is installed, and on the staging machine that has no torch at all.

    python tools/gpu/versions.py                        # reads the installed torch
    python tools/gpu/versions.py --torch 2.11.0+cu130   # CUDA taken from the +cu130 tag
    python tools/gpu/versions.py --torch 2.11.0 --cuda 13.0 --format json
    python tools/gpu/versions.py --constraints          # torch (+ its CUDA wheels) pinned
    python tools/gpu/versions.py --from-report r.json   # stager: what to download
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pins:
    vllm: str
    megatron_core: str
    transformer_engine: str


# torch major.minor -> the releases built against it. vLLM pins torch exactly (0.20-0.26:
# torch==2.11.0, 0.27-0.32: torch==2.13.0), so the vLLM release decides the row; the
# newest release of each band is used. megatron-core 0.16 declares transformer-engine
# >=2.9,<2.12, hence TE 2.11 in both rows.
TABLE: dict[str, Pins] = {
    "2.11": Pins(vllm="0.26.0", megatron_core="0.16.1", transformer_engine="2.11.0"),
    "2.13": Pins(vllm="0.32.0", megatron_core="0.16.1", transformer_engine="2.11.0"),
}

# CUDA major -> the Transformer Engine core wheel (libtransformer_engine) built for it.
TE_CORE: dict[int, str] = {12: "transformer-engine-cu12", 13: "transformer-engine-cu13"}

# The torch extension of TE: source-only on PyPI, built on the GPU machine against its torch.
TE_TORCH = "transformer_engine_torch"


class PinError(ValueError):
    """A torch/CUDA pair this table cannot serve; the message is one line with the fix."""


def torch_minor(torch_version: str) -> str:
    """'2.11.0+cu130' -> '2.11'."""
    match = re.match(r"^(\d+)\.(\d+)", torch_version.strip())
    if not match:
        raise PinError(f"cannot read torch version {torch_version!r}: expected e.g. 2.11.0+cu130")
    return f"{match.group(1)}.{match.group(2)}"


def cuda_major(torch_version: str, cuda_version: str | None) -> int:
    """The CUDA major version, from `torch.version.cuda` or else the +cuXYZ local tag."""
    if cuda_version:
        match = re.match(r"^(\d+)", cuda_version.strip())
        if match:
            return int(match.group(1))
    tag = re.search(r"\+cu(\d+)$", torch_version.strip())
    if tag and len(tag.group(1)) >= 3:
        return int(tag.group(1)[:-1])
    raise PinError(
        f"torch {torch_version} has no CUDA (torch.version.cuda is empty): use a machine "
        "with a CUDA build of torch, or name one (--torch 2.11.0+cu130, or --cuda 13.0)"
    )


def pins_for(torch_version: str, cuda_version: str | None) -> dict[str, str]:
    """Package name -> exact version for this torch, in install order."""
    minor = torch_minor(torch_version)
    if minor not in TABLE:
        supported = ", ".join(sorted(TABLE))
        raise PinError(
            f"no vLLM release matches torch {torch_version}: supported torch versions are "
            f"{supported}; use a machine with one of them or add a row to tools/gpu/versions.py"
        )
    major = cuda_major(torch_version, cuda_version)
    if major not in TE_CORE:
        supported = ", ".join(str(k) for k in sorted(TE_CORE))
        raise PinError(
            f"no Transformer Engine wheel for CUDA {major}: supported CUDA majors are "
            f"{supported}; use a torch built for one of them"
        )
    row = TABLE[minor]
    return {
        "vllm": row.vllm,
        "megatron-core": row.megatron_core,
        # The meta package holds no code of its own here but megatron-core and TE's own
        # version checks look it up by this name.
        "transformer-engine": row.transformer_engine,
        TE_CORE[major]: row.transformer_engine,
        TE_TORCH: row.transformer_engine,
    }


def requirement_lines(pins: dict[str, str]) -> list[str]:
    return [f"{name}=={version}" for name, version in pins.items()]


def installed_torch() -> tuple[str, str | None]:
    """(torch.__version__, torch.version.cuda) of the running interpreter."""
    try:
        import torch
    except ImportError as exc:
        raise PinError(
            f"torch does not import in {sys.executable} ({exc}): run with the machine's "
            "python (PYTHON=...) or pass --torch VERSION"
        ) from exc
    return str(torch.__version__), torch.version.cuda


def _dist_name(requirement: str) -> str:
    return _parse_requirement(requirement)[0]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def constraint_lines(torch_version: str, detect: bool) -> list[str]:
    """Constraints that make pip fail instead of replacing the machine's torch stack.

    With detect, the installed versions of torch's own binary dependencies (nvidia-*,
    triton) and of torchvision/torchaudio are pinned too: vLLM names several of them and
    a different build of any one breaks torch.
    """
    lines = [f"torch=={torch_version}"]
    if not detect:
        return lines
    from importlib import metadata

    try:
        requires = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        return lines
    names = {_dist_name(r) for r in requires if "extra ==" not in r}
    names = {n for n in names if n.startswith("nvidia-") or n == "triton"}
    names |= {"torchvision", "torchaudio"}
    for name in sorted(names):
        try:
            lines.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return lines


def _parse_requirement(requirement: str) -> tuple[str, set[str], set[str]]:
    """'cuda-toolkit[nvcc,cublas]==13.0; extra == "x"' -> (name, {extras}, {marker extras})."""
    match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
    if not match:
        return "", set(), set()
    extras = {normalize(e) for e in (match.group(2) or "").split(",") if e.strip()}
    _, _, marker = requirement.partition(";")
    marker_extras = {normalize(e) for e in re.findall(r"extra\s*==\s*[\"']([^\"']+)", marker)}
    return normalize(match.group(1)), extras, marker_extras


def _closure(entries: dict[str, dict], root: str) -> set[str]:
    """Names reachable from root through the report's requires_dist, following extras."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset())]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name not in entries:
            continue
        seen.add((name, extras))
        for requirement in entries[name]["metadata"].get("requires_dist") or []:
            dep, dep_extras, marker_extras = _parse_requirement(requirement)
            if not marker_extras or marker_extras & extras:
                todo.append((dep, frozenset(dep_extras)))
    return {name for name, _ in seen}


# What vLLM declares but an offline `LLM` on a text MoE model never imports: kernel
# libraries for other models and attention backends (DeepSeek MLA, CuTe DSL, TileLang,
# FlashInfer and its JIT toolchain) and video decoding. Together about 500 MB, more than the
# rest of the set; `--lean` leaves them out and installs with --no-deps (vLLM imports each
# behind an availability check and falls back). Not apache-tvm-ffi: xgrammar, which vLLM
# imports to build its sampler, needs it (H100, 2026-11-25).
LEAN_SKIP = frozenset({
    "cuda-tile", "fastsafetensors", "flashinfer-python", "humming-kernels",
    "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-cuda-nvcc", "nvidia-cuda-nvdisasm",
    "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "nvidia-nvvm", "pynvvideocodec",
    "quack-kernels", "ruff", "tilelang", "tokenspeed-mla", "tokenspeed-triton", "torch-c-dlpack-ext",
    "torchcodec", "z3-solver",
})
ANY_VERSION = "*"


def read_have(text: str) -> dict[str, str]:
    """What the GPU machine has -> {normalized name: version}. Lines are `pip list
    --format=freeze` (`name==version`: left out only at that version) or a bare name (left
    out at any version: the machine's own build is the one to use)."""
    have = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        have[normalize(name)] = version.strip() if sep else ANY_VERSION
    return have


def downloads_from_report(report: dict, have: dict[str, str] | None = None, lean: bool = False) -> list[str]:
    """`name==version` for every resolved package the GPU machine needs shipped.

    Left out: torch itself, the binary wheels torch pulls in (nvidia-*, triton: the
    machine has the builds its torch was made with, and they are gigabytes), local
    projects (moe_rl itself travels as the checkout), and whatever the machine already
    has at exactly the resolved version (`have`, from its `pip list --format=freeze`; a
    bare name there: at any version), and with `lean` the packages in LEAN_SKIP.
    Pure-Python dependencies of torch stay in: they are small, and a newer one may be
    what another package asks for.
    """
    have = have or {}
    entries = {normalize(e["metadata"]["name"]): e for e in report.get("install", [])}
    skip = {"torch"} | (set(LEAN_SKIP) if lean else set())
    for name in _closure(entries, "torch"):
        url = entries[name].get("download_info", {}).get("url", "")
        if not url.endswith("-none-any.whl"):
            skip.add(name)
    lines = []
    for name, entry in sorted(entries.items()):
        version = entry["metadata"]["version"]
        local_project = "dir_info" in entry.get("download_info", {})  # a checkout, not a file
        if name in skip or local_project or have.get(name) in (version, ANY_VERSION):
            continue
        lines.append(f"{entry['metadata']['name']}=={version}")
    return lines


def _make_lines(torch_version: str, pins: dict[str, str]) -> list[str]:
    te_core = next(name for name in pins if name in TE_CORE.values())
    return [
        f"TORCH_VERSION := {torch_version}",
        f"VLLM_VERSION := {pins['vllm']}",
        f"MEGATRON_CORE_VERSION := {pins['megatron-core']}",
        f"TE_CORE_PACKAGE := {te_core}",
        f"TE_VERSION := {pins[TE_TORCH]}",
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", help="torch version, e.g. 2.11.0+cu130 (default: installed)")
    parser.add_argument("--cuda", help="CUDA version, e.g. 13.0 (default: torch's, or +cuXYZ)")
    parser.add_argument("--format", choices=("pip", "json", "make"), default="pip")
    parser.add_argument(
        "--constraints", action="store_true", help="print the pip constraints instead"
    )
    parser.add_argument(
        "--from-report", type=Path, help="pip --report JSON -> name==version lines to download"
    )
    parser.add_argument(
        "--have", type=Path, help="with --from-report: the GPU machine's `pip list --format=freeze` (or bare names)"
    )
    parser.add_argument("--lean", action="store_true", help="with --from-report: leave out LEAN_SKIP")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.from_report is not None:
            report = json.loads(args.from_report.read_text())
            have = read_have(args.have.read_text()) if args.have else None
            print("\n".join(downloads_from_report(report, have, lean=args.lean)))
            return 0
        if args.torch:
            torch_version, cuda_version = args.torch, args.cuda
        else:
            torch_version, cuda_version = installed_torch()
            cuda_version = args.cuda or cuda_version
        if args.constraints:
            print("\n".join(constraint_lines(torch_version, detect=not args.torch)))
            return 0
        pins = pins_for(torch_version, cuda_version)
    except PinError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps({"torch": torch_version, "pins": pins}, indent=2))
    elif args.format == "make":
        print("\n".join(_make_lines(torch_version, pins)))
    else:
        print("\n".join(requirement_lines(pins)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
