"""Checkpoint conversion throughput and peak memory: megatron checkpoint -> Hugging Face
directory, against a plain safetensors read + write of the same bytes.

    python -m bench.run_all convert            # ~2 GB checkpoint (fp32)
    python -m bench.run_all convert --quick    # ~50 MB, one round

The checkpoint is made by the learner's own `save_checkpoint` (a fresh, wider model in a
child process), so it has megatron's real DCP layout: one torch-serialised chunk per
expert and SwiGLU half. Each measurement runs in a fresh child process; its wall time
covers the work only (not the imports), its peak RSS is the kernel's high-water mark for
that process (`getrusage(RUSAGE_SELF).ru_maxrss`, imports included), and an "idle" child that only imports the same
modules gives the RSS floor. Rounds alternate conversion and copy; the median round is
reported. Both read from the page cache (the files were just written) and write into it
(no fsync; `os.sync()` before each run, outside the timing, so that no run is throttled by
its predecessor's dirty pages): this is memory-bandwidth-bound throughput, not disk
throughput.
The copy is what a plain tool would do: `safetensors.torch.load_file` each output shard
and `save_file` it elsewhere, so it holds a whole shard in memory; the converter holds
one megatron tensor at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_rl.config import to_dict
from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

# ~1.93 GB fp32: 4 MoE layers of 32 experts (hidden 1024, expert ffn 1024), 32k vocab, untied.
FULL = ["model.num_layers=4", "model.hidden_size=1024", "model.num_attention_heads=8",
        "model.num_query_groups=4", "model.kv_channels=128", "model.ffn_hidden_size=2048",
        "model.num_experts=32", "model.moe_router_topk=4", "model.moe_ffn_hidden_size=1024",
        "model.vocab_size=32768", "model.max_position_embeddings=4096"]
# ~54 MB: same shape family, smaller.
QUICK = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.kv_channels=64", "model.ffn_hidden_size=512",
         "model.num_experts=12", "model.moe_ffn_hidden_size=256", "model.vocab_size=8192"]


# --------------------------------------------------------------------------- children


def _child_make(out: str, overrides: list[str]) -> dict:
    from moe_rl.config import load_config
    from moe_rl.learner.checkpoint import save_checkpoint
    from moe_rl.learner.engine import Learner
    from moe_rl.learner.parallel import init_distributed, parallel_layout

    init_distributed()
    cfg = load_config(None, overrides)
    with parallel_layout(cfg.parallel, seed=0) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout)
        save_checkpoint(learner, out, recipe=to_dict(cfg))
    return {}


def _cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child_convert(src: str, dst: str) -> dict:
    from moe_rl.convert import megatron_to_hf

    t0, c0 = time.perf_counter(), _cpu_seconds()
    megatron_to_hf(src, dst)
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": _cpu_seconds() - c0}


def _child_copy(src: str, dst: str) -> dict:
    from safetensors.torch import load_file, save_file

    t0, c0 = time.perf_counter(), _cpu_seconds()
    os.makedirs(dst)
    for shard in sorted(Path(src).glob("*.safetensors")):
        save_file(load_file(shard), os.path.join(dst, shard.name), metadata={"format": "pt"})
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": _cpu_seconds() - c0}


def _child_idle() -> dict:
    import safetensors.torch  # noqa: F401

    import moe_rl.convert  # noqa: F401
    return {}


def _run_child(*args: str) -> dict:
    """Run `python -m bench.cpu.bench_convert --child ...` and return its JSON result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "bench.cpu.bench_convert", "--child", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{stderr[-4000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def _timed(*args: str) -> dict:
    """A measured child, started with no dirty pages: the kernel throttles writers once dirty
    pages pass vm.dirty_ratio, so without the sync a run would pay for its predecessor's
    writes (2 GB per run against a ~4 GB threshold here)."""
    os.sync()
    return _run_child(*args)


def _child_main(argv: list[str]) -> None:
    import resource

    what, *rest = argv
    if what == "make":
        out = _child_make(rest[0], rest[1:])
    elif what == "convert":
        out = _child_convert(*rest)
    elif what == "copy":
        out = _child_copy(*rest)
    elif what == "idle":
        out = _child_idle()
    else:
        raise SystemExit(f"unknown child {what}")
    # The kernel's high-water mark of this process's resident set (KiB on Linux).
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


# --------------------------------------------------------------------------- benchmark


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def main(quick: bool = False) -> None:
    rounds = 1 if quick else 5  # (quick: 5 children in all, make + idle + 3, instead of 13)
    with tempfile.TemporaryDirectory(prefix="bench_convert-", dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        _run_child("make", str(tmp / "ckpt"), *(QUICK if quick else FULL))
        make_s = time.perf_counter() - t0
        ckpt_bytes = sum(p.stat().st_size for p in (tmp / "ckpt").glob("*.distcp"))
        idle = _run_child("idle")
        convert, copy = [], []
        convert.append(_timed("convert", str(tmp / "ckpt"), str(tmp / "hf")))  # the copy's input
        hf_bytes = _dir_bytes(tmp / "hf")
        for i in range(rounds):
            # Alternate which goes first, so that neither always inherits the other's load.
            pair = [("convert", str(tmp / "ckpt"), str(tmp / "out")), ("copy", str(tmp / "hf"), str(tmp / "out"))]
            for what, src, dst in pair[:: 1 if i % 2 else -1]:
                (convert if what == "convert" else copy).append(_timed(what, src, dst))
                shutil.rmtree(dst)
        convert = convert[1:]
        from moe_rl.convert import DcpCheckpoint

        infos = DcpCheckpoint(tmp / "ckpt").tensors.values()
        largest = max(i.dtype.itemsize * _numel(i.shape) for i in infos)
    mb = hf_bytes / 1e6

    def row(name: str, runs: list[dict]) -> list:
        s = statistics.median(r["seconds"] for r in runs)
        cpu = statistics.median(r["cpu_seconds"] for r in runs)
        rss = max(r["max_rss_mb"] for r in runs)
        return [name, round(mb, 1), s, mb / s, cpu, rss, rss - idle["max_rss_mb"]]

    rows = [row("convert megatron -> HF (moe_rl.convert)", convert),
            row("safetensors load_file + save_file copy", copy)]
    ratio = rows[0][3] / rows[1][3]
    table = markdown_table(
        ["operation", "MB written", "seconds (median)", "MB/s", "CPU seconds (median)", "peak RSS MB",
         "RSS over idle MB"], rows)
    table += f"\nThroughput ratio convert / copy: **{ratio:.2f}** (target >= 0.5).\n"
    load = os.getloadavg()
    notes = (
        f"{'Quick' if quick else 'Full'} run: {ckpt_bytes / 1e6:.0f} MB checkpoint (fp32; "
        f"{' '.join(o.removeprefix('model.') for o in (QUICK if quick else FULL))}) made by "
        f"`save_checkpoint` in {make_s:.0f} s; largest megatron tensor {largest / 1e6:.0f} MB; one "
        f"{mb:.0f} MB output shard (default 2 GiB shards). Median of {rounds} rounds (order alternating, `os.sync()` before each), each in "
        f"a fresh process (OMP_NUM_THREADS=1); idle child RSS {idle['max_rss_mb']:.0f} MB. Files are in "
        f"the page cache, writes are not fsynced. Load average at the end: "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (shared 2-core machine)."
    )
    write_results("convert", {"quick": quick, "rows": rows, "ratio": ratio, "checkpoint_bytes": ckpt_bytes,
                              "output_bytes": hf_bytes, "largest_tensor_bytes": largest,
                              "idle_rss_mb": idle["max_rss_mb"], "rounds": {"convert": convert, "copy": copy}},
                  table, notes)
    print(table)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=argparse.REMAINDER)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.child:
        _child_main(args.child)
    else:
        main(quick=args.quick)
