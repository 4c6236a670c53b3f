"""The GPU install path (tools/gpu/), checked on CPU without a network: version pins, the
commands install.sh would run (--dry-run), the Makefile wiring, and the wheel chunks."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from types import ModuleType

import pytest

from moe_rl_testing import ROOT

GPU_TOOLS = ROOT / "tools" / "gpu"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU_TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while building
    spec.loader.exec_module(module)
    return module


versions = _load("versions")
chunks = _load("chunks")


def _dry_run(torch_version: str, cuda: str, wheels: str, *flags: str) -> str:
    result = subprocess.run(
        ["bash", str(GPU_TOOLS / "install.sh"), "--dry-run", "--torch", torch_version,
         "--cuda", cuda, *flags, *([wheels] if wheels else [])],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize(
    ("torch_version", "cuda", "vllm", "te_core"),
    [
        ("2.11.0+cu130", None, "0.26.0", "transformer-engine-cu13"),
        ("2.13.0+cu128", None, "0.32.0", "transformer-engine-cu12"),
        ("2.11.0", "13.0", "0.26.0", "transformer-engine-cu13"),
    ],
)
def test_pins_follow_torch_and_cuda(torch_version, cuda, vllm, te_core):
    pins = versions.pins_for(torch_version, cuda)
    assert pins["vllm"] == vllm
    assert pins["megatron-core"] == "0.16.1"
    assert pins[te_core] == "2.11.0"
    assert pins["transformer_engine_torch"] == "2.11.0"
    assert "torch" not in pins


def test_unknown_torch_is_a_one_line_error_naming_supported_versions():
    with pytest.raises(versions.PinError) as caught:
        versions.pins_for("2.9.0+cu128", None)
    message = str(caught.value)
    assert "\n" not in message
    assert "2.9.0" in message and "2.11" in message and "2.13" in message


@pytest.mark.parametrize("torch_version", ["2.11.0", "2.11.0+cpu"])
def test_torch_without_cuda_is_an_error(torch_version):
    with pytest.raises(versions.PinError, match="no CUDA"):
        versions.pins_for(torch_version, None)


def test_cli_prints_pip_lines_and_fails_cleanly(capsys):
    assert versions.main(["--torch", "2.11.0+cu130"]) == 0
    assert capsys.readouterr().out.split() == [
        "vllm==0.26.0", "megatron-core==0.16.1", "transformer-engine==2.11.0",
        "transformer-engine-cu13==2.11.0", "transformer_engine_torch==2.11.0",
    ]
    assert versions.main(["--torch", "2.9.0"]) == 2
    assert capsys.readouterr().err.startswith("error: no vLLM release matches torch 2.9.0")


def test_report_filter_leaves_out_torch_and_its_cuda_wheels():
    def entry(name, version, url, requires=()):
        return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
                "download_info": {"url": url}}

    report = {"install": [
        entry("vllm", "0.26.0", "https://x/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl",
              ["torch==2.11.0", "regex"]),
        entry("torch", "2.11.0", "https://x/torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl",
              ["filelock", "cuda-toolkit[cublas]==13.0.2", "triton==3.6.0"]),
        entry("cuda-toolkit", "13.0.2", "https://x/cuda_toolkit-13.0.2-py3-none-any.whl",
              ['nvidia-cublas==13.1; extra == "cublas"', 'nvidia-cufft; extra == "cufft"']),
        entry("nvidia-cublas", "13.1", "https://x/nvidia_cublas-13.1-py3-none-manylinux_2_27_x86_64.whl"),
        entry("nvidia-cufft", "12.0", "https://x/nvidia_cufft-12.0-py3-none-manylinux_2_27_x86_64.whl"),
        entry("triton", "3.6.0", "https://x/triton-3.6.0-cp312-cp312-manylinux_2_28_x86_64.whl"),
        entry("filelock", "4.2", "https://x/filelock-4.2-py3-none-any.whl"),
        entry("regex", "2026.1", "https://x/regex-2026.1-cp312-cp312-manylinux_2_28_x86_64.whl"),
        entry("moe_rl", "0.1.0", "file:///work/main"),
        entry("wheel", "0.48", "file:///mirror/wheel-0.48-py3-none-any.whl"),
    ]}
    report["install"][-2]["download_info"]["dir_info"] = {}  # how pip marks a local project
    assert versions.downloads_from_report(report) == [
        "cuda-toolkit==13.0.2", "filelock==4.2", "nvidia-cufft==12.0", "regex==2026.1",
        "vllm==0.26.0", "wheel==0.48",
    ]
    have = versions.read_have("regex==2026.1\nfilelock==4.0\n")
    assert "regex==2026.1" not in versions.downloads_from_report(report, have)
    # a bare name (the machine image's list): left out at any version
    have = versions.read_have("# the image\nfilelock\n")
    assert [x for x in versions.downloads_from_report(report, have) if x.startswith("filelock")] == []
    assert "regex==2026.1" in versions.downloads_from_report(report, have)


def test_lean_staging_leaves_out_vllms_optional_kernels_but_not_what_xgrammar_needs():
    def entry(name, version):
        return {"metadata": {"name": name, "version": version, "requires_dist": []},
                "download_info": {"url": f"https://x/{name}-{version}-py3-none-any.whl"}}

    report = {"install": [entry("vllm", "0.26.0"), entry("tilelang", "0.1.9"), entry("flashinfer-python", "0.6.14"),
                          entry("nvidia-cutlass-dsl", "4.6.0"), entry("apache-tvm-ffi", "0.1.10"),
                          entry("xgrammar", "0.2.7")]}
    assert versions.downloads_from_report(report, lean=True) == [
        "apache-tvm-ffi==0.1.10", "vllm==0.26.0", "xgrammar==0.2.7"]
    assert len(versions.downloads_from_report(report)) == 6
    image = versions.read_have((GPU_TOOLS / "cuda_image_have.txt").read_text())
    assert {"torch", "transformers", "triton", "numpy"} <= set(image)
    assert "vllm" not in image and "megatron-core" not in image


@pytest.mark.parametrize(
    ("torch_version", "cuda", "vllm", "te_core"),
    [("2.11.0+cu130", "13.0", "0.26.0", "transformer-engine-cu13"),
     ("2.13.0+cu128", "12.8", "0.32.0", "transformer-engine-cu12")],
)
def test_install_dry_run_plans_an_offline_install_that_keeps_torch(torch_version, cuda, vllm, te_core):
    out = _dry_run(torch_version, cuda, "/wheels")
    pip_lines = [line for line in out.splitlines() if " -m pip install " in line]
    assert len(pip_lines) == 5
    for line in pip_lines:
        assert "--no-index --find-links /wheels" in line
        assert " -c " in line  # the torch constraint file on every pip call
    assert f"torch=={torch_version}" in out  # ... and what it holds
    assert "chunks.py join /wheels" in out
    assert any(f"vllm=={vllm}" in line for line in pip_lines)
    assert any(f"{te_core}==2.11.0" in line and "megatron-core==0.16.1" in line
               for line in pip_lines)
    te_build = next(line for line in pip_lines if "transformer_engine_torch==2.11.0" in line)
    for needle in ("NVTE_PYTORCH_FORCE_BUILD=TRUE", "NVTE_FRAMEWORK=pytorch", "MAX_JOBS=",
                   "CPLUS_INCLUDE_PATH=", "--no-build-isolation"):
        assert needle in te_build
    assert any("-e " in line and "[dev]" in line.replace("\\", "")  # printf %q escapes [ ]
               and "--no-build-isolation" in line for line in pip_lines)
    for line in pip_lines:  # never a torch of its own
        assert " torch " not in f"{line} " and " torch==" not in line
    assert "verification" in out


def test_lean_install_dry_run_installs_the_staged_wheels_as_they_are(tmp_path):
    for name in ("vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", "megatron_core-0.16.1-py3-none-any.whl",
                 "transformer_engine_cu13-2.11.0-py3-none-manylinux_2_28_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    out = _dry_run("2.11.0+cu130", "13.0", str(tmp_path), "--lean", "--without", "vllm")
    pip_lines = [line for line in out.splitlines() if " -m pip install " in line]
    wheels = pip_lines[0]
    assert "--no-deps" in wheels and "megatron_core" in wheels and "transformer_engine_cu13" in wheels
    assert "vllm-0.26.0" not in wheels  # --without vllm
    assert any("transformer_engine_torch==2.11.0" in line for line in pip_lines)  # TE's extension is built
    assert not any("-e " in line for line in pip_lines)  # the checkout goes on sys.path by a .pth file
    assert "moe_rl_checkout.pth" in out and "pip check" in out
    out = _dry_run("2.11.0+cu130", "13.0", str(tmp_path), "--lean", "--without", "te")
    pip_lines = [line for line in out.splitlines() if " -m pip install " in line]
    assert "vllm-0.26.0" in pip_lines[0] and "transformer_engine_cu13" not in pip_lines[0]
    assert not any("transformer_engine_torch" in line for line in pip_lines)


@pytest.mark.parametrize(("flags", "message"), [(["--without", "vllm"], "--without only works with --lean"),
                                                (["--lean"], "--lean needs the WHEELS_DIR"),
                                                (["--lean", "--without", "cuda"], "--without takes vllm or te")])
def test_lean_install_flags_are_checked(flags, message):
    result = subprocess.run(["bash", str(GPU_TOOLS / "install.sh"), "--dry-run", "--torch", "2.11.0+cu130", *flags],
                            capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode != 0 and message in result.stderr


def test_install_without_wheels_uses_the_registry():
    out = _dry_run("2.11.0+cu130", "13.0", "")
    assert "--no-index" not in out and "chunks.py" not in out
    assert "vllm==0.26.0" in out


def test_install_real_run_refuses_a_torch_override():
    result = subprocess.run(["bash", str(GPU_TOOLS / "install.sh"), "--torch", "2.11.0+cu130"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "--torch only works with --dry-run" in result.stderr


def test_make_install_gpu_calls_install_sh(tmp_path):
    result = subprocess.run(
        ["make", "-n", "install", "ACCEL=gpu", "WHEELS=/x", f"VENV={tmp_path}/venv",
         "PYTHON=false"],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert f"PYTHON={tmp_path}/venv/bin/python tools/gpu/install.sh /x" in result.stdout
    assert "--system-site-packages" in result.stdout
    assert "pip install" not in result.stdout  # everything goes through install.sh


def test_make_install_cpu_path_is_unchanged(tmp_path):
    out = subprocess.run(["make", "-n", "install", "ACCEL=cpu", f"VENV={tmp_path}/v"],
                         capture_output=True, text=True, timeout=30, cwd=ROOT).stdout
    assert "install -q torch==2.13.0" in out and "tools/gpu" not in out


def test_chunks_round_trip(tmp_path):
    data = os.urandom(1000)
    wheel = tmp_path / "big-1.0-py3-none-any.whl"
    wheel.write_bytes(data)
    (tmp_path / "small.whl").write_bytes(b"x" * 10)
    chunks.write_sums(tmp_path)
    pieces = chunks.split_dir(tmp_path, max_bytes=300)
    assert not wheel.exists()
    assert sorted(p.name for p in pieces if "part" in p.name) == [
        f"{wheel.name}.part-{i:03d}" for i in range(4)]
    assert all(p.stat().st_size <= 300 for p in pieces)
    assert chunks.plan_transfers([p.stat().st_size for p in pieces], limit=700) == 2
    assert chunks.join(tmp_path) == [wheel]
    assert wheel.read_bytes() == data
    assert hashlib.sha256(data).hexdigest() in (tmp_path / "SHA256SUMS").read_text()
    assert not list(tmp_path.glob("*.part-*"))


def test_chunks_join_rejects_a_bad_chunk(tmp_path):
    wheel = tmp_path / "w.whl"
    wheel.write_bytes(b"a" * 100)
    chunks.write_sums(tmp_path)
    chunks.split(wheel, 40)
    (tmp_path / "w.whl.part-001").write_bytes(b"b" * 40)
    with pytest.raises(chunks.ChunkError, match="SHA-256") as caught:
        chunks.join(tmp_path)
    assert "\n" not in str(caught.value) and not wheel.exists()
    (tmp_path / "w.whl.part-001").unlink()
    with pytest.raises(chunks.ChunkError, match="missing"):
        chunks.join(tmp_path)


def test_stage_wheels_dry_run_lists_every_step(tmp_path):
    result = subprocess.run(
        ["bash", str(GPU_TOOLS / "stage_wheels.sh"), str(tmp_path / "w"), "--torch",
         "2.13.0+cu128", "--dry-run"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "vllm==0.32.0" in out and "transformer-engine-cu12==2.11.0" in out
    assert "--platform manylinux_2_28_x86_64" in out and "--platform manylinux2014_x86_64" in out
    assert "--only-binary=:all:" in out and "pip download --no-deps" in out
    assert "sdist.py transformer_engine_torch 2.11.0" in out
    assert "chunks.py split" in out and "--max-mib 50" in out
    assert not (tmp_path / "w").exists()  # a dry run writes nothing


def test_make_gpu_check_installs_then_runs_the_gpu_tests_and_the_benchmark(tmp_path):
    out = subprocess.run(
        ["make", "-n", "gpu-check", "ACCEL=gpu", "WHEELS=/w", f"VENV={tmp_path}/venv", "PYTHON=false"],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
    ).stdout
    install = out.index(f"PYTHON={tmp_path}/venv/bin/python tools/gpu/install.sh /w")
    tests = out.index(f"{tmp_path}/venv/bin/python -m pytest -m gpu")
    bench = out.index(f"{tmp_path}/venv/bin/python -m bench.device.bench_gpu")
    assert install < tests < bench
    assert out.count("timeout 1080") == 2  # the tests and the benchmark, each under its own 18-minute timeout


def test_make_gpu_check_on_a_cpu_machine_is_a_one_line_error():
    result = subprocess.run(["make", "gpu-check", "ACCEL=cpu"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode != 0
    assert "make gpu-check needs a CUDA machine" in result.stderr
