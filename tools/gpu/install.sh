#!/usr/bin/env bash
# Install the GPU stack (vLLM, megatron-core, Transformer Engine, moe_rl) into the CURRENT
# python, on top of the machine's own CUDA torch, which is never replaced.
#
#   tools/gpu/install.sh [--dry-run] [--torch VERSION --cuda VERSION] [--lean]
#                        [--without vllm|te] [--te-torch-only] [WHEELS_DIR]
#
# PYTHON (default python3) is the interpreter to install into; `make install ACCEL=gpu`
# passes a venv made with --system-site-packages so the machine's torch shows through.
# WHEELS_DIR: a folder filled by tools/gpu/stage_wheels.sh (chunks are joined and checked
# against its SHA256SUMS); pip then never looks at a registry (--no-index). Without it,
# pip uses the configured registry.
# --dry-run prints every command instead of running it; --torch/--cuda stand in for the
# installed torch there (so the plan for another machine can be read anywhere).
# --lean: WHEELS_DIR holds a set staged with `stage_wheels.sh --lean`: every wheel in it is
# installed as it is (--no-deps, nothing resolved; the machine's own packages fill the
# rest), then `pip check` lists what is still unmet, as information. --without vllm / te
# (repeatable, lean only) leaves that half out, e.g. to start the learner's half while the
# vLLM wheels are still on their way.
# --te-torch-only: compile transformer_engine_torch from WHEELS_DIR's sdist and stop (it needs
# only torch, so it can build while the big wheels are still arriving); a later full install
# finds it built at the pinned version and does not compile it again.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
DRY_RUN=0
LEAN=0
WITHOUT=""
TE_TORCH_ONLY=0
OVERRIDE=0
TORCH_VERSION=""
CUDA_VERSION=""
WHEELS=""

die() { echo "error: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --lean) LEAN=1 ;;
    --te-torch-only) TE_TORCH_ONLY=1 ;;
    --without)
      case "${2:-}" in vllm|te) WITHOUT="$WITHOUT ${2}" ;; *) die "--without takes vllm or te, not '${2:-}'" ;; esac
      shift ;;
    --torch) TORCH_VERSION="${2:?--torch needs a version, e.g. 2.11.0+cu130}"; OVERRIDE=1; shift ;;
    --cuda) CUDA_VERSION="${2:?--cuda needs a version, e.g. 13.0}"; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) die "unknown option $1: see tools/gpu/install.sh --help" ;;
    *) [[ -z "$WHEELS" ]] || die "more than one WHEELS_DIR ($WHEELS, $1): pass one folder"
       WHEELS="$1" ;;
  esac
  shift
done

if [[ -n "$WITHOUT" && $LEAN -eq 0 ]]; then
  die "--without only works with --lean (a resolved install takes vLLM and TE together)"
fi
[[ $LEAN -eq 0 || -n "$WHEELS" ]] || die "--lean needs the WHEELS_DIR that stage_wheels.sh --lean filled"
without() { [[ " $WITHOUT " == *" $1 "* ]]; }

# Installing pins for a torch that is not the installed one would build TE against the
# wrong headers, so the override only exists for reading the plan.
if [[ $OVERRIDE -eq 1 && $DRY_RUN -eq 0 ]]; then
  die "--torch only works with --dry-run: a real install always uses the installed torch"
fi

# run CMD...: print it (dry run) or print and run it. Environment assignments go through
# `env` so that the printed line is also a runnable line.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ $DRY_RUN -eq 0 ]]; then "$@"; fi
}

if [[ $OVERRIDE -eq 0 ]]; then
  # torch must already be there (with its CUDA): this script never installs one.
  detected="$("$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda or "")' 2>/dev/null)" \
    || die "torch does not import in $PYTHON: use the machine's python (PYTHON=...) or a venv made with --system-site-packages"
  read -r TORCH_VERSION detected_cuda <<<"$detected"
  CUDA_VERSION="${CUDA_VERSION:-${detected_cuda:-}}"
fi

# versions.py fails with a one-line reason for a torch without a matching vLLM or CUDA.
pin_args=(--torch "$TORCH_VERSION")
[[ -z "$CUDA_VERSION" ]] || pin_args+=(--cuda "$CUDA_VERSION")
pins="$("$PYTHON" "$HERE/versions.py" "${pin_args[@]}" --format make)" || exit 1
VLLM_VERSION="$(sed -n 's/^VLLM_VERSION := //p' <<<"$pins")"
MEGATRON_CORE_VERSION="$(sed -n 's/^MEGATRON_CORE_VERSION := //p' <<<"$pins")"
TE_CORE_PACKAGE="$(sed -n 's/^TE_CORE_PACKAGE := //p' <<<"$pins")"
TE_VERSION="$(sed -n 's/^TE_VERSION := //p' <<<"$pins")"
echo "gpu install: torch $TORCH_VERSION (CUDA ${CUDA_VERSION:-from tag}) -> vllm $VLLM_VERSION, megatron-core $MEGATRON_CORE_VERSION, $TE_CORE_PACKAGE $TE_VERSION"

# The constraint file is what keeps torch: any package asking for another torch (or another
# build of torch's own CUDA wheels) makes pip fail instead of replacing it.
if [[ $OVERRIDE -eq 1 ]]; then
  constraints_text="$("$PYTHON" "$HERE/versions.py" --torch "$TORCH_VERSION" --constraints)"
else
  constraints_text="$("$PYTHON" "$HERE/versions.py" --constraints)"
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/moe_rl-gpu-install.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
CONSTRAINTS="$WORK/constraints.txt"
printf '%s\n' "$constraints_text" >"$CONSTRAINTS"
echo "constraints ($CONSTRAINTS): $(tr '\n' ' ' <"$CONSTRAINTS")"

pip_src=()
if [[ -n "$WHEELS" ]]; then
  [[ -d "$WHEELS" || $DRY_RUN -eq 1 ]] || die "$WHEELS is not a directory: pass the folder tools/gpu/stage_wheels.sh filled"
  WHEELS="$(cd "$WHEELS" 2>/dev/null && pwd || echo "$WHEELS")"
  # Big wheels arrive as NAME.part-NNN chunks; put them back (SHA-256 checked) first. The
  # extension alone needs none of them (they may still be on their way).
  [[ $TE_TORCH_ONLY -eq 1 ]] || run "$PYTHON" "$HERE/chunks.py" join "$WHEELS"
  pip_src=(--no-index --find-links "$WHEELS")
fi
pip=("$PYTHON" -m pip install "${pip_src[@]}" -c "$CONSTRAINTS")

if [[ $TE_TORCH_ONLY -eq 1 ]]; then
  [[ -n "$WHEELS" ]] || die "--te-torch-only needs the WHEELS_DIR holding the transformer_engine_torch sdist"
elif [[ $LEAN -eq 1 ]]; then
  # Exactly the staged wheels, in one pip call (no resolution: the lean set lacks vLLM's
  # optional kernels on purpose, and the machine's packages stand for the rest).
  wheels=()
  for w in "$WHEELS"/*.whl; do
    [[ -e "$w" ]] || continue
    base="$(basename "$w")"
    if without vllm && [[ "$base" == vllm-* ]]; then continue; fi
    if without te && [[ "$base" == transformer_engine* ]]; then continue; fi
    wheels+=("$w")
  done
  [[ ${#wheels[@]} -gt 0 || $DRY_RUN -eq 1 ]] || die "no wheels in $WHEELS: fill it with tools/gpu/stage_wheels.sh --lean"
  [[ ${#wheels[@]} -eq 0 ]] || run "${pip[@]}" --no-deps "${wheels[@]}"
else
  # Build tools for the TE extension and for moe_rl's editable install, both built without
  # isolation (an isolated build would fetch a fresh torch).
  run "${pip[@]}" setuptools wheel ninja
  run "${pip[@]}" "vllm==$VLLM_VERSION"
  run "${pip[@]}" "megatron-core==$MEGATRON_CORE_VERSION" "transformer-engine==$TE_VERSION" "$TE_CORE_PACKAGE==$TE_VERSION"
fi

build_te_torch() {
  if [[ $DRY_RUN -eq 0 && "$("$PYTHON" -m pip show transformer_engine_torch 2>/dev/null | sed -n 's/^Version: //p')" == "$TE_VERSION" ]]; then
    echo "transformer_engine_torch $TE_VERSION is already built for this torch: not compiled again"
    return 0
  fi
  # transformer_engine_torch is source-only on PyPI: compile it against this torch. Its
  # build looks for the CUDA toolkit (PATH, CUDA_HOME, or /usr/local/cuda) for the headers.
  # The folder of cudnn.h inside the nvidia wheels (nvidia/cudnn/include, or under a cu13/ level).
  cudnn_probe='import glob, os, nvidia; print(next(os.path.dirname(h) for d in nvidia.__path__ for h in sorted(glob.glob(os.path.join(d, "**", "cudnn.h"), recursive=True))))'
  if [[ $OVERRIDE -eq 1 ]]; then
    # Planning for another machine: this one's cuDNN location says nothing about it.
    cudnn_include='<site-packages>/nvidia/cudnn/include'
  elif [[ $DRY_RUN -eq 1 ]]; then
    cudnn_include="$("$PYTHON" -c "$cudnn_probe" 2>/dev/null || echo '<site-packages>/nvidia/cudnn/include')"
  else
    # The same search order as TE's build: CUDA_HOME, then PATH, then /usr/local/cuda.
    if [[ -n "${CUDA_HOME:-}" ]]; then
      [[ -x "$CUDA_HOME/bin/nvcc" ]] || die "no nvcc in CUDA_HOME=$CUDA_HOME/bin (needed to build transformer_engine_torch): point CUDA_HOME at the CUDA toolkit"
    elif ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
      die "nvcc not found (needed to build transformer_engine_torch): set CUDA_HOME to the CUDA toolkit or put its bin/ on PATH"
    fi
    # cuDNN headers come with the nvidia-cudnn wheel torch depends on, not with the toolkit.
    cudnn_include="$("$PYTHON" -c "$cudnn_probe")" \
      || die "no cudnn.h in the nvidia wheels of $PYTHON: install the nvidia-cudnn-cu${CUDA_VERSION%%.*} wheel torch was built with"
  fi
  run env NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch MAX_JOBS="$(nproc)" \
    CPLUS_INCLUDE_PATH="$cudnn_include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    "${pip[@]}" --no-build-isolation --no-deps "transformer_engine_torch==$TE_VERSION"
}
without te || build_te_torch
if [[ $TE_TORCH_ONLY -eq 1 ]]; then exit 0; fi

# moe_rl itself, editable; its pure-Python dependencies (setup.py) come under the same
# constraints. Not the [gpu] extra: `transformer-engine[pytorch]` there would build the
# extension again in an isolated environment with a fresh torch.
if [[ $LEAN -eq 1 ]]; then
  # The checkout on sys.path through a .pth file (what an editable install amounts to): pip's
  # editable path needs a build backend from a registry when setuptools is older than PEP 660.
  pth='import site, sys; d = site.getsitepackages()[0]; open(d + "/moe_rl_checkout.pth", "w").write(sys.argv[1] + "\n"); print(d + "/moe_rl_checkout.pth")'
  run "$PYTHON" -c "$pth" "$ROOT"
  # Information, not a failure: the lean set leaves vLLM's optional kernels out on purpose.
  if [[ $DRY_RUN -eq 0 ]]; then "$PYTHON" -m pip check || true; else echo "+ $PYTHON -m pip check"; fi
else
  run "${pip[@]}" --no-build-isolation -e "$ROOT[dev]"
fi

# `import transformer_engine` succeeds without the compiled extension, so the check is on
# transformer_engine.pytorch.
verify="$(cat <<'PY'
import importlib.metadata as md
import sys

import torch


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "missing"


try:
    import transformer_engine.pytorch  # noqa: F401

    te_pytorch = "imports"
except Exception as exc:  # the reason is the report
    first = str(exc).splitlines()[0] if str(exc) else repr(exc)
    te_pytorch = f"FAILS ({type(exc).__name__}: {first})"
print(
    f"gpu stack: torch {torch.__version__} (CUDA {torch.version.cuda}, GPU visible:"
    f" {torch.cuda.is_available()}) | transformer-engine {version('transformer-engine')},"
    f" transformer_engine.pytorch {te_pytorch} | vllm {version('vllm')}"
    f" | megatron-core {version('megatron-core')}"
)
if torch.__version__ != sys.argv[1]:
    sys.exit(f"error: torch changed from {sys.argv[1]} to {torch.__version__}: reinstall the machine's torch and report which package replaced it")
sys.exit(0 if te_pytorch == "imports" or sys.argv[2] == "no-te" else 1)
PY
)"
if [[ $DRY_RUN -eq 1 ]]; then
  echo "+ $PYTHON -c <verification: torch, CUDA, TE, transformer_engine.pytorch, vLLM, megatron-core> $TORCH_VERSION"
else
  run "$PYTHON" -c "$verify" "$TORCH_VERSION" "$(without te && echo no-te || echo te)"
fi
