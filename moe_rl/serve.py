"""Serve a checkpoint behind the run's OpenAI-compatible endpoint, outside a run: try an agent,
unchanged, before training it (docs/tools.md, "Agents").

    python -m moe_rl.serve --checkpoint moe_rl/assets/tool_base --port 8000
    python examples/agents/calculator_agent.py http://127.0.0.1:8000/v1

The same gateway as a run's (`moe_rl.rollout.gateway`): `POST /v1/chat/completions` (tools
shown by the checkpoint's chat template, `tool_calls` parsed by its parser) and
`GET /v1/models`. Here no episode key is needed (any api key), and a request's `n`,
`temperature`, `top_p`, `max_tokens` and `seed` are honoured. The checkpoint is a Hugging
Face directory or a moe_rl checkpoint (converted to a temporary Hugging Face directory first);
its tokenizer is the one `task.tokenizer=auto` would load, or `--tokenizer`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moe_rl.rollout.gateway.server import Gateway
from moe_rl.rollout.gateway.trajectory import Budget


def start_server(checkpoint: str | Path, *, port: int = 0, tokenizer: str = "auto", backend: str = "transformers",
                 max_tokens: int = 256, work_dir: Path | None = None, trust: bool = False) -> Gateway:
    """A started serve-mode gateway over `checkpoint` on 127.0.0.1:`port` (0: a free one)."""
    from moe_rl.rollout.sampler_start import sampler_weights_dir
    from moe_rl.sampler import make_sampler
    from moe_rl.sampler.engine_config import ENGINE_CONFIGS
    from moe_rl.tokenization import load_tokenizer

    source = Path(checkpoint)
    tok = load_tokenizer(tokenizer, str(source))
    if not getattr(tok, "chat_template", None):
        raise SystemExit(f"moe_rl.serve: the tokenizer of {source} has no chat template; pass --tokenizer DIR with one")
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="moe_rl_serve_"))
    hf_dir = sampler_weights_dir(work_dir, source, trust)
    sampler = make_sampler(hf_dir, ENGINE_CONFIGS[backend](eos_token_ids=tuple(tok.eos_ids)))
    gateway = Gateway(sampler, tok, tok.chat_template, budget=Budget(1, max_tokens, 1 << 30), serve=True,
                      model_name=source.name, port=port)
    gateway.start()
    return gateway


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(prog="python -m moe_rl.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a Hugging Face directory or a moe_rl checkpoint")
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--tokenizer", default="auto", help="auto (the checkpoint's) or a tokenizer directory")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--max-tokens", type=int, default=256, help="a request's tokens when it gives no max_tokens")
    parser.add_argument("--trust-checkpoint", action="store_true", help="read a checkpoint without a manifest")
    return serve_forever(parser.parse_args(argv))


def serve_forever(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C (then the port is closed)."""
    gateway = start_server(args.checkpoint, port=args.port, tokenizer=args.tokenizer, backend=args.backend,
                           max_tokens=args.max_tokens, trust=args.trust_checkpoint)
    print(f"moe_rl.serve: {args.checkpoint} at {gateway.url} (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        gateway.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
