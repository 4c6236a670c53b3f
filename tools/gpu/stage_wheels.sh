#!/usr/bin/env bash
# On a machine WITH registry access: fill DIR with every wheel (and the one sdist) that
# tools/gpu/install.sh needs on a GPU machine WITHOUT one, split for 64 MiB transfers.
#
#   tools/gpu/stage_wheels.sh DIR [--torch 2.11.0+cu130] [--cuda 13.0] [--python 3.12]
#                                 [--glibc 2.39] [--have FREEZE.txt] [--lean] [--dry-run]
#
# --torch: the GPU machine's torch.__version__ (its CUDA comes from the +cuXYZ tag unless
#   --cuda says otherwise). --glibc: the GPU machine's glibc (`ldd --version`); wheels
#   tagged for a newer one would not install there. --have: the GPU machine's
#   `pip list --format=freeze`; packages it already has at the resolved version are left out
#   (a bare name: at any version; tools/gpu/cuda_image_have.txt lists the lent machines').
#   --lean: also leave out vLLM's optional kernel and video packages (versions.py LEAN_SKIP);
#   install such a set with `tools/gpu/install.sh --lean`.
# PYTHON (default python3) only runs pip here; it need not be 3.12 nor have torch.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
DIR=""
TORCH_VERSION="2.11.0+cu130"
CUDA_VERSION=""
PY_VERSION="3.12"
GLIBC="2.39"  # Ubuntu 24.04, what the lent GPU machines (Python 3.12.3) run
HAVE=""
LEAN=0
DRY_RUN=0

die() { echo "error: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch) TORCH_VERSION="${2:?--torch needs a version, e.g. 2.11.0+cu130}"; shift ;;
    --cuda) CUDA_VERSION="${2:?--cuda needs a version, e.g. 13.0}"; shift ;;
    --python) PY_VERSION="${2:?--python needs a version, e.g. 3.12}"; shift ;;
    --glibc) GLIBC="${2:?--glibc needs a version, e.g. 2.39}"; shift ;;
    --have) HAVE="${2:?--have needs a pip freeze file}"; shift ;;
    --lean) LEAN=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) die "unknown option $1: see tools/gpu/stage_wheels.sh --help" ;;
    *) [[ -z "$DIR" ]] || die "more than one DIR ($DIR, $1): pass one folder"; DIR="$1" ;;
  esac
  shift
done
[[ -n "$DIR" ]] || die "no DIR given: tools/gpu/stage_wheels.sh DIR [--torch 2.11.0+cu130]"
[[ -z "$HAVE" || -f "$HAVE" ]] || die "--have $HAVE does not exist: write it on the GPU machine with pip list --format=freeze"
[[ "$GLIBC" =~ ^2\.([0-9]+)$ ]] || die "--glibc $GLIBC is not like 2.39: pass the GPU machine's ldd --version"
glibc_minor="${BASH_REMATCH[1]}"

run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ $DRY_RUN -eq 0 ]]; then "$@"; fi
}

pin_args=(--torch "$TORCH_VERSION")
[[ -z "$CUDA_VERSION" ]] || pin_args+=(--cuda "$CUDA_VERSION")
pins="$("$PYTHON" "$HERE/versions.py" "${pin_args[@]}" --format make)" || exit 1
VLLM_VERSION="$(sed -n 's/^VLLM_VERSION := //p' <<<"$pins")"
MEGATRON_CORE_VERSION="$(sed -n 's/^MEGATRON_CORE_VERSION := //p' <<<"$pins")"
TE_CORE_PACKAGE="$(sed -n 's/^TE_CORE_PACKAGE := //p' <<<"$pins")"
TE_VERSION="$(sed -n 's/^TE_VERSION := //p' <<<"$pins")"
echo "staging for torch $TORCH_VERSION, Python $PY_VERSION, glibc $GLIBC: vllm $VLLM_VERSION, megatron-core $MEGATRON_CORE_VERSION, $TE_CORE_PACKAGE $TE_VERSION"

# pip's --platform takes exact tags: a manylinux_2_28 target must also list every older
# manylinux tag, or wheels built for older glibc (most of PyPI) are not found.
platforms=()
for ((minor = glibc_minor; minor >= 5; minor--)); do
  platforms+=(--platform "manylinux_2_${minor}_x86_64")
done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
target=(--python-version "$PY_VERSION" "${platforms[@]}" --only-binary=:all:)

WORK="$(mktemp -d "${TMPDIR:-/tmp}/moe_rl-stage.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# The public torch release (PyPI has no +cu130 local tag) only steers the resolution;
# torch itself is never downloaded.
printf 'torch==%s\n' "${TORCH_VERSION%%+*}" >"$WORK/constraints.txt"

run mkdir -p "$DIR"
# 1. Resolve the whole set as the GPU machine would (metadata only, nothing installed).
run "$PYTHON" -m pip install --dry-run --ignore-installed --quiet --report "$WORK/report.json" \
  --target "$WORK/target" "${target[@]}" -c "$WORK/constraints.txt" \
  "$ROOT[dev]" "vllm==$VLLM_VERSION" "megatron-core==$MEGATRON_CORE_VERSION" \
  "transformer-engine==$TE_VERSION" "$TE_CORE_PACKAGE==$TE_VERSION" setuptools wheel ninja
# 2. Keep what the machine lacks: not torch, not torch's CUDA wheels, not moe_rl itself.
have_args=()
[[ -z "$HAVE" ]] || have_args=(--have "$HAVE")
[[ $LEAN -eq 0 ]] || have_args+=(--lean)
if [[ $DRY_RUN -eq 1 ]]; then
  echo "+ $PYTHON $HERE/versions.py --from-report $WORK/report.json ${have_args[*]} > $WORK/download.txt"
else
  "$PYTHON" "$HERE/versions.py" --from-report "$WORK/report.json" "${have_args[@]}" >"$WORK/download.txt"
  echo "$(wc -l <"$WORK/download.txt") packages to download"
fi
run "$PYTHON" -m pip download --no-deps "${target[@]}" -d "$DIR" -r "$WORK/download.txt"
# 3. The TE torch extension exists only as an sdist; install.sh compiles it on the GPU.
run "$PYTHON" "$HERE/sdist.py" transformer_engine_torch "$TE_VERSION" "$DIR"
# 4. Checksums of the whole files, then chunks of at most 50 MiB (one 64 MiB transfer
#    leaves room for the rest of a call).
run "$PYTHON" "$HERE/chunks.py" sums "$DIR"
run "$PYTHON" "$HERE/chunks.py" split "$DIR" --max-mib 50
run "$PYTHON" "$HERE/chunks.py" plan "$DIR" --transfer-mib 64
