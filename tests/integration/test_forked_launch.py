"""`moe_rl_testing.forked`: processes forked from the preloaded zygote are processes of
their own (pid, world, exit status, signals, atexit, output), a failed rank ends its world
as torchrun ends it, and what the zygote cannot stand for runs as a fresh interpreter; which
command lines it forks and what it gives the child."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from moe_rl_testing import ROOT, forked

PY = sys.executable
WORLD = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
line = (f"rank={os.environ['RANK']} world={dist.get_world_size()} sum={t.item()} pid={os.getpid()} "
        f"parent={os.getppid()} name={__name__} argv={sys.argv[1:]} path0={sys.path[0]}")
os.write(1, (line + "\\n").encode())  # (one write: the ranks share the stream)
if sys.argv[1:] == ["fail"]:
    if dist.get_rank() == 1:
        sys.exit(5)
    import time
    time.sleep(600)  # torchrun (and forked) end this rank once rank 1 has failed
dist.destroy_process_group()
"""


def _env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**keep, **forked.ZYGOTE_ENV, **extra}


@pytest.fixture(scope="module")
def world_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("forked") / "world.py"
    path.write_text(WORLD)
    return path


def _fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split(" ", 6)[:6]) | {"rest": line.split(" ", 6)[6]}


@pytest.mark.multiproc
def test_a_torchrun_world_of_forked_ranks(world_script):
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(world_script), "a"]
    proc = forked.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ranks = sorted((_fields(ln) for ln in proc.stdout.splitlines()), key=lambda f: f["rank"])
    assert [(f["rank"], f["world"], f["sum"]) for f in ranks] == [("0", "2", "3.0"), ("1", "2", "3.0")]
    pids = {f["pid"] for f in ranks}
    assert len(pids) == 2 and str(os.getpid()) not in pids  # two processes, neither this one
    zygote = str(forked.zygote().proc.pid)
    assert all(f["parent"] == zygote for f in ranks)  # forked, not started by an interpreter
    assert all(f["rest"] == f"argv=['a'] path0={world_script.parent}" for f in ranks)
    assert all(f["name"] == "__main__" for f in ranks)


@pytest.mark.multiproc
def test_a_failed_rank_ends_its_world_as_torchrun_does(world_script, tmp_path):
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(world_script), "fail"]
    launch = forked.start(cmd, env=_env(), cwd=ROOT, stderr=str(tmp_path / "err"))
    t0 = time.monotonic()
    assert launch.wait(timeout=120) == 1
    codes = [forked.zygote().exit_code(p) for p in launch.pids]
    assert codes == [-signal.SIGTERM, 5], codes  # rank 1's own status; rank 0 ended by the launcher
    assert time.monotonic() - t0 < 60


def test_a_plain_process_exits_as_the_interpreter_would(tmp_path):
    def code(src: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
        return forked.run([PY, "-c", src, "x"], env=env or _env(), capture_output=True, text=True, timeout=60, **kw)

    ran = code("import sys, atexit; atexit.register(print, 'atexit ran'); print(sys.argv, __name__); sys.exit(3)")
    assert (ran.returncode, ran.stdout) == (3, "['-c', 'x'] __main__\natexit ran\n")
    ran = code("raise ValueError('boom')")
    assert ran.returncode == 1 and ran.stderr.rstrip().endswith("ValueError: boom") and "Traceback" in ran.stderr
    assert "zygote" not in ran.stderr and "runpy" not in ran.stderr  # the program's frames only
    ran = code("import sys; sys.exit('a message')")
    assert (ran.returncode, ran.stderr) == (1, "a message\n")
    ran = code("import os, signal; print('up', flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    assert (ran.returncode, ran.stdout) == (-signal.SIGKILL, "up\n")
    ran = code("import os; print(os.getcwd(), os.environ['MARK'])", cwd=tmp_path, env=_env(MARK="m"))
    assert ran.stdout == f"{tmp_path} m\n"
    assert code("import sys; sys.exit(-1)").returncode == 255  # a status, not a signal
    assert code("raise KeyboardInterrupt").returncode == -signal.SIGINT  # as the interpreter ends then


def test_a_child_starts_from_a_fresh_process_random_state():
    """Not the zygote's copy: Python's and numpy's drawn anew, torch's at its default seed."""
    src = "import random, numpy, torch; print(random.random(), numpy.random.rand(), torch.initial_seed())"
    a, b = (forked.run([PY, "-c", src], env=_env(), capture_output=True, text=True).stdout.split() for _ in "ab")
    assert a[0] != b[0] and a[1] != b[1] and a[2] == b[2] == "67280421310721"


def test_a_timeout_kills_the_process():
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([PY, "-c", "import time; print('up', flush=True); time.sleep(600)"], env=_env(),
                   capture_output=True, text=True, timeout=3)
    assert time.monotonic() - t0 < 30


def test_what_the_zygote_cannot_stand_for_runs_in_a_fresh_interpreter():
    """Import-time variables other than the zygote's: a plain subprocess (megatron-core not
    preloaded there), the same answer otherwise."""
    code = "import sys; print('megatron' in sys.modules)"
    assert forked.run([PY, "-c", code], env=_env(), capture_output=True, text=True).stdout == "True\n"
    assert forked.start([PY, "-c", code], env=_env(PYTHONHASHSEED="0")) is None
    fresh = forked.run([PY, "-c", code], env=_env(PYTHONHASHSEED="0"), capture_output=True, text=True)
    assert (fresh.returncode, fresh.stdout) == (0, "False\n")


def test_parse_reads_the_forms_the_tests_use():
    run = [PY, "-m", "torch.distributed.run", "--standalone"]
    assert forked._parse([PY, "-m", "moe_rl.train", "--config", "x.yaml"]) == \
        (0, "module", "moe_rl.train", ["moe_rl.train", "--config", "x.yaml"])
    assert forked._parse([PY, "w.py", "a"]) == (0, "script", "w.py", ["w.py", "a"])
    assert forked._parse([PY, "-c", "print(1)", "a"]) == (0, "code", "print(1)", ["-c", "a"])
    assert forked._parse([*run, "--nproc-per-node=2", "-m", "moe_rl.train", "r"]) == \
        (2, "module", "moe_rl.train", ["moe_rl.train", "r"])
    assert forked._parse([*run, "--nproc_per_node=4", "w.py"]) == (4, "script", "w.py", ["w.py"])


def test_parse_leaves_what_it_cannot_stand_for_to_subprocess():
    run = [PY, "-m", "torch.distributed.run"]
    assert forked._parse(["git", "status"]) is None  # not this interpreter
    assert forked._parse([PY, "-u", "w.py"]) is None  # an interpreter option
    assert forked._parse([*run, "--nnodes=2", "--nproc-per-node=2", "w.py"]) is None  # another torchrun option
    assert forked._parse([*run, "--standalone", "w.py"]) is None  # no process count
    assert forked._parse([*run, "--nproc-per-node=2", "-c", "print(1)"]) is None  # torchrun runs no -c


def test_child_path_is_pythons_and_refuses_another_checkouts_moe_rl(tmp_path):
    base = ["/lib/python3.11", "/site-packages"]
    assert forked._child_path("module", "moe_rl.train", {"PYTHONPATH": "extra"}, str(tmp_path), base) == \
        [str(tmp_path), str(tmp_path / "extra"), *base]
    (tmp_path / "w.py").touch()
    assert forked._child_path("script", "w.py", {}, str(tmp_path), base)[0] == str(tmp_path)
    assert forked._child_path("code", "", {}, str(ROOT), base)[0] == ""
    (tmp_path / "moe_rl").mkdir()
    (tmp_path / "moe_rl" / "__init__.py").touch()  # a clone of the repository, say
    assert forked._child_path("module", "moe_rl.train", {}, str(tmp_path), base) is None
    assert forked._child_path("code", "", {"PYTHONPATH": str(tmp_path)}, str(ROOT), base) is None


def test_torchrun_variables_name_each_rank_of_one_local_world():
    env = forked._torchrun_env({"A": "1"}, ranks=2, rank=1, port=29555)
    assert {k: env[k] for k in ("A", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")} == \
        {"A": "1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def test_import_time_variables_must_match_the_zygotes():
    zyg = SimpleNamespace(env={"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", **forked.PROGRAM_DEFAULTS})
    same = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "MOE_RL_TEST_KILL_AT": "x", "RANK": "1",
            "PYTHONPATH": "/else", "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert forked._import_mismatch(same, zyg) is None  # read at run time: the child's own
    assert forked._import_mismatch({**same, "VLLM_LOGGING_LEVEL": "ERROR"}, zyg) is None  # a program's default
    assert forked._import_mismatch({**same, "OMP_NUM_THREADS": "2"}, zyg) == "OMP_NUM_THREADS"
    assert forked._import_mismatch({k: v for k, v in same.items() if k != "TORCHDYNAMO_DISABLE"}, zyg) == \
        "TORCHDYNAMO_DISABLE"
    assert forked._import_mismatch({**same, "PYTHONHASHSEED": "0"}, zyg) == "PYTHONHASHSEED"
    assert forked._import_mismatch({**same, "VLLM_LOGGING_LEVEL": "DEBUG"}, zyg) == "VLLM_LOGGING_LEVEL"


def test_rank_exit_codes_from_the_launcher_or_torchruns_report():
    forked_world = subprocess.CompletedProcess([], 1, "", "")
    forked_world.rank_codes = [-signal.SIGTERM, 3]
    assert forked.rank_exit_codes(forked_world) == {0: -15, 1: 3}
    report = ("Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-29_20:00:00\n  host      : h\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : 3 (pid: 4242)\n  error_file: <N/A>\n")
    assert forked.rank_exit_codes(subprocess.CompletedProcess([], 1, "", report)) == {1: 3}
