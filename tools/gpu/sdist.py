"""Download one source distribution from the package index, checked against its SHA-256.

`pip download` cannot fetch transformer_engine_torch: it prepares the sdist's metadata,
and that runs a setup.py needing torch and a CUDA toolkit, which the staging machine
need not have. This reads the index's simple API (PEP 691 JSON, the one pip itself
uses), so it honours PIP_INDEX_URL / `pip config` like pip does.

    python tools/gpu/sdist.py transformer_engine_torch 2.11.0 DIR
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

DEFAULT_INDEX = "https://pypi.org/simple"
_JSON = "application/vnd.pypi.simple.v1+json"


class SdistError(RuntimeError):
    """No usable sdist; the message is one line with the fix."""


def index_url() -> str:
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    try:
        configured = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True, text=True, check=False, timeout=60,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        configured = ""
    return configured or DEFAULT_INDEX


def sdist_file_name(name: str, version: str) -> str:
    """PEP 625 name of the sdist: transformer_engine_torch-2.11.0.tar.gz."""
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}.tar.gz"


def find_sdist(project_json: dict, name: str, version: str) -> dict:
    wanted = sdist_file_name(name, version)
    for entry in project_json.get("files", []):
        if entry.get("filename", "").lower() == wanted.lower():
            return entry
    raise SdistError(
        f"no {wanted} on the index: check the version ({name} {version}) or PIP_INDEX_URL"
    )


def fetch(name: str, version: str, dest: Path, index: str | None = None) -> Path:
    base = (index or index_url()).rstrip("/")
    project = re.sub(r"[-_.]+", "-", name).lower()
    request = urllib.request.Request(f"{base}/{project}/", headers={"Accept": _JSON})
    with urllib.request.urlopen(request, timeout=120) as response:
        entry = find_sdist(json.load(response), name, version)
    url = urllib.parse.urljoin(f"{base}/{project}/", entry["url"])
    target = dest / entry["filename"]
    with urllib.request.urlopen(url, timeout=600) as response:
        data = response.read()
    expected = entry.get("hashes", {}).get("sha256")
    actual = hashlib.sha256(data).hexdigest()
    if expected and actual != expected:
        raise SdistError(f"{entry['filename']}: SHA-256 {actual} != index's {expected}: download again")
    target.write_bytes(data)
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: sdist.py NAME VERSION DIR", file=sys.stderr)
        return 2
    try:
        print(fetch(args[0], args[1], Path(args[2])))
    except (SdistError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
