"""An engine-only rank of a separate placement never imports megatron-core: the modules its
build runs (joining the world, the rollout collector, the weight receiver, the vLLM sampler,
the engine role) are checked in a fresh process, as a rank starts. (Seconds of start-up on
the path every step-1 rollout waits for; the learner's `init_distributed` adds megatron's
patches on the ranks that train.)"""

from __future__ import annotations

import subprocess
import sys

from moe_rl_testing import ROOT

ENGINE_RANK_MODULES = ("moe_rl.train", "moe_rl.programs.rl.learner_role", "moe_rl.programs.rl.engine_role",
                       "moe_rl.runtime.process_group", "moe_rl.rollout.collector", "moe_rl.weights",
                       "moe_rl.weights.verify", "moe_rl.sampler.precision", "moe_rl.sampler.vllm_backend")


def test_an_engine_rank_builds_without_megatron():
    code = (f"import sys\nfor m in {ENGINE_RANK_MODULES!r}: __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"

