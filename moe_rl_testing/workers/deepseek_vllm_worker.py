"""Subprocess side of tests/integration/convert/test_deepseek_v3.py::test_vllm_serves_and_takes_the_stream (vLLM's
engine wants its own process): start vLLM (fp32, CPU) on directory A, score fixed prompts;
then stream directory B's tensors into it under the names the learner streams (every
tensor but the MTP layer's) and score again. Writes {"a": scores, "b": scores} to OUT.

    deepseek_vllm_worker.py OUT DIR_A DIR_B
"""

import json
import os
import sys
from pathlib import Path

from safetensors.torch import load_file

from moe_rl_testing.deepseek_fixtures import VLLM_PROMPTS as PROMPTS
from moe_rl_testing.deepseek_fixtures import VLLM_RESPONSES as RESPONSES


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from moe_rl.sampler import VLLMEngineConfig, make_sampler

    out, dir_a, dir_b = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    layers = json.loads((dir_b / "config.json").read_text())["num_hidden_layers"]
    sampler = make_sampler(dir_a, VLLMEngineConfig(precision="fp32", seed=0, max_model_len=64))
    scores = {"a": sampler.score(PROMPTS, RESPONSES)}
    tensors = load_file(str(dir_b / "model.safetensors"))
    sampler.update_weights((n, t) for n, t in tensors.items() if not n.startswith(f"model.layers.{layers}."))
    scores["b"] = sampler.score(PROMPTS, RESPONSES)
    sampler.close()
    Path(out).write_text(json.dumps(scores))


if __name__ == "__main__":
    main()
