#!/usr/bin/env bash
# The GPU check in steps short enough for a lent machine that takes at most 64 MiB and
# 10 minutes a call and keeps its disk only while it stays warm (the device tool of this
# workplace; any machine where `make gpu-check` cannot run in one go).
#
#   tools/gpu/lease.sh receive                 copy .gpu/*/{learner,rollout}/ into $MOE_RL_WHEELS
#   tools/gpu/lease.sh probe                   versions, GPU, compiler, disk -> stdout and $OUT
#   tools/gpu/lease.sh install-bg learner|rollout
#                                              tools/gpu/install.sh --lean for that half, in the
#                                              background (it outlives the call), log in /tmp
#   tools/gpu/lease.sh build-te-bg             compile transformer_engine_torch alone, in the
#                                              background, from the learner half's sdist (it
#                                              needs only torch: start it with the first chunk)
#   tools/gpu/lease.sh wait learner|rollout|te [S]
#                                              wait up to S seconds for it; its log's end
#   tools/gpu/lease.sh test learner|rollout    pytest -m gpu for that half -> $OUT/test_HALF.log
#   tools/gpu/lease.sh bench learner|rollout   bench/device/bench_gpu.py --part HALF -> $OUT
#   tools/gpu/lease.sh mismatch                tools/measure_mismatch.py, bf16 and vLLM fp8 -> $OUT
#   tools/gpu/lease.sh profile [LAYERS]        bench/device/profile_gpu.py: where a bf16 step's time goes -> $OUT
#   tools/gpu/lease.sh learner-all             after the last chunk: wait for the extension, install
#                                              the learner half, then bench, profile, the head's
#                                              bench (bench/cpu/bench_head.py) and tests, each
#                                              under its own timeout (one call, ~8 minutes)
#   tools/gpu/lease.sh rl-all [LAYERS]         device check 1 of issue 45 after the last chunk: install
#                                              the rollout half without TE (vLLM + megatron-core, the
#                                              local spec), then bench/device/gpu_rl_step.py: moe_rl.train with
#                                              vLLM, R3 and the weight push, and the mismatch report
#                                              (one call, under 10 minutes) -> $OUT
#
# Staging (on a machine with a registry): tools/gpu/stage_wheels.sh DIR --lean --have
# tools/gpu/cuda_image_have.txt, then split DIR's learner/ and rollout/ files over folders
# .gpu/t01, .gpu/t02, ... of at most 64 MiB less the checkout, each sent by one call's carry.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
W="${MOE_RL_WHEELS:-/tmp/moe_rl_wheels}"
OUT="${OUT:-/tmp/moe_rl_out}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
die() { echo "error: $*" >&2; exit 1; }
half() { [[ "${1:-}" == learner || "${1:-}" == rollout ]] || die "name the half: learner or rollout, not '${1:-}'"; }

case "${1:-}" in
  receive)
    mkdir -p "$W/learner" "$W/rollout"
    for d in .gpu/*/; do
      for h in learner rollout; do if [[ -d "$d$h" ]]; then cp -r "$d$h/." "$W/$h/"; fi; done
      rm -rf "$d"  # received: a later call need not copy it again
    done
    du -sh "$W"/* ;;
  probe)
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
      "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())'
      nvcc --version | tail -2
      ldd --version | head -1
      df -h /tmp | tail -1
      "$PYTHON" -m pip list --format=freeze
    } 2>&1 | tee "$OUT/probe.txt" | head -12 ;;
  install-bg)
    half "${2:-}"
    without=$([[ "$2" == learner ]] && echo vllm || echo te)
    rm -f "/tmp/moe_rl_install_$2.rc"
    setsid bash -c "tools/gpu/install.sh --lean --without $without '$W/$2' >/tmp/moe_rl_install_$2.log 2>&1; echo \$? >/tmp/moe_rl_install_$2.rc" \
      </dev/null >/dev/null 2>&1 &
    echo "installing the $2 half in the background: /tmp/moe_rl_install_$2.log" ;;
  build-te-bg)
    rm -f /tmp/moe_rl_install_te.rc
    setsid bash -c "tools/gpu/install.sh --lean --te-torch-only '$W/learner' >/tmp/moe_rl_install_te.log 2>&1; echo \$? >/tmp/moe_rl_install_te.rc" \
      </dev/null >/dev/null 2>&1 &
    echo "compiling transformer_engine_torch in the background: /tmp/moe_rl_install_te.log" ;;
  wait)
    [[ "${2:-}" == te ]] || half "${2:-}"
    for ((i = 0; i < ${3:-600}; i++)); do [[ -f "/tmp/moe_rl_install_$2.rc" ]] && break; sleep 1; done
    tail -n 15 "/tmp/moe_rl_install_$2.log" || true
    cp "/tmp/moe_rl_install_$2.log" "$OUT/install_$2.log" 2>/dev/null || true
    [[ -f "/tmp/moe_rl_install_$2.rc" ]] || die "the $2 install is still running"
    [[ "$(cat "/tmp/moe_rl_install_$2.rc")" == 0 ]] || die "the $2 install failed: see $OUT/install_$2.log" ;;
  test)
    half "${2:-}"
    if [[ "$2" == learner ]]; then sel=(tests/integration/learner/test_gpu_learner.py -m "gpu and not vllm"); else
      sel=(tests/integration/rollout/test_gpu_rollout.py tests/integration/learner/test_gpu_learner.py -m "gpu and vllm"); fi
    PYTHONUNBUFFERED=1 "$PYTHON" -m pytest "${sel[@]}" -v -s -rs -p no:cacheprovider --timeout 900 \
      2>&1 | tee "$OUT/test_$2.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" || true ;;
  bench)
    half "${2:-}"
    PYTHONUNBUFFERED=1 "$PYTHON" -m bench.device.bench_gpu --part "$2" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$2.log" | tail -n 25
    cp bench/results/gpu_*_"$2".md bench/results/gpu_*_"$2".json "$OUT/" ;;
  mismatch)
    "$PYTHON" tools/measure_mismatch.py --settings vllm:bf16/learner:bf16 vllm:fp8/learner:bf16 \
      vllm:bf16/learner:fp32 --out /tmp/moe_rl_mismatch --no-progress 2>&1 | tail -n 25
    tar czf "$OUT/mismatch_h100.tgz" -C /tmp moe_rl_mismatch ;;
  profile)
    PYTHONUNBUFFERED=1 "$PYTHON" -m bench.device.profile_gpu --layers "${2:-1}" 2>&1 | tee "$OUT/profile.log" | tail -n 70
    cp bench/results/gpu_*_profile.md "$OUT/" ;;
  learner-all)
    rc=0
    "$0" receive
    "$0" wait te 200 || rc=1
    timeout 150 tools/gpu/install.sh --lean --without vllm "$W/learner" >"$OUT/install_learner.log" 2>&1 || rc=1
    tail -n 4 "$OUT/install_learner.log"
    BENCH_ARGS="${BENCH_ARGS:---iters 3}" timeout 300 "$0" bench learner || rc=1
    timeout 90 "$0" profile 1 || rc=1
    PYTHONUNBUFFERED=1 timeout 90 "$PYTHON" -m bench.cpu.bench_head 2>&1 | tail -n 8 || rc=1
    timeout 150 "$0" test learner || rc=1
    exit $rc ;;
  rl-all)
    rc=0
    "$0" receive
    timeout 150 tools/gpu/install.sh --lean --without te "$W/rollout" >"$OUT/install_rollout.log" 2>&1 || rc=1
    tail -n 4 "$OUT/install_rollout.log"
    PYTHONUNBUFFERED=1 timeout 400 "$PYTHON" -m bench.device.gpu_rl_step --layers "${2:-2}" --timeout 180 2>&1 \
      | tail -n 30 || rc=1
    cp bench/results/gpu_*_rl_step.* "$OUT/" 2>/dev/null || rc=1
    tar czf "$OUT/mismatch_report.tgz" -C docs mismatch 2>/dev/null || rc=1
    exit $rc ;;
  -h|--help) sed -n '2,32p' "$0" ;;
  *) sed -n '2,32p' "$0"; exit 2 ;;
esac
