"""Split big wheel files into chunks small enough for one transfer, and put them back.

The GPU machines have no package registry: wheels travel in transfers of at most 64 MiB,
so the stager splits every file over 50 MiB into NAME.part-000, NAME.part-001, ... and
records each original file's SHA-256 in SHA256SUMS (`sha256sum` format), which `join`
checks after reassembly so a lost or truncated chunk fails loudly instead of as a
corrupt-zip error deep inside pip.

    python tools/gpu/chunks.py sums DIR                # write DIR/SHA256SUMS
    python tools/gpu/chunks.py split DIR [--max-mib 50]
    python tools/gpu/chunks.py join DIR
    python tools/gpu/chunks.py plan DIR [--transfer-mib 64]   # total size, transfers
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

SUMS = "SHA256SUMS"
MIB = 1024 * 1024
DEFAULT_MAX_BYTES = 50 * MIB
TRANSFER_BYTES = 64 * MIB
_PART = re.compile(r"^(?P<name>.+)\.part-(?P<index>\d{3,})$")


class ChunkError(RuntimeError):
    """A chunk set that cannot be reassembled; the message is one line with the fix."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def write_sums(directory: Path) -> Path:
    """SHA256SUMS over every plain file in directory (chunks and the sums file excluded)."""
    lines = [
        f"{sha256(path)}  {path.name}"
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != SUMS and not _PART.match(path.name)
    ]
    target = directory / SUMS
    target.write_text("".join(line + "\n" for line in lines))
    return target


def read_sums(directory: Path) -> dict[str, str]:
    sums_file = directory / SUMS
    if not sums_file.is_file():
        raise ChunkError(f"{sums_file} is missing: copy it over with the chunks (the stager writes it)")
    sums: dict[str, str] = {}
    for line in sums_file.read_text().splitlines():
        if line.strip():
            digest, _, name = line.partition("  ")
            sums[name.lstrip("*")] = digest
    return sums


def split(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """Cut path into path.part-NNN files of at most max_bytes and remove path.

    A file no bigger than max_bytes is left alone (returned as the only piece).
    """
    if max_bytes <= 0:
        raise ChunkError(f"max_bytes must be positive, got {max_bytes}")
    if path.stat().st_size <= max_bytes:
        return [path]
    parts: list[Path] = []
    with path.open("rb") as source:
        while block := source.read(max_bytes):
            part = path.with_name(f"{path.name}.part-{len(parts):03d}")
            part.write_bytes(block)
            parts.append(part)
    path.unlink()
    return parts


def split_dir(directory: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """Split every file over max_bytes; SHA256SUMS must already describe the originals."""
    pieces: list[Path] = []
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != SUMS and not _PART.match(path.name):
            pieces.extend(split(path, max_bytes))
    return pieces


def join(directory: Path) -> list[Path]:
    """Reassemble every NAME.part-NNN set into NAME, check it against SHA256SUMS, and
    remove the parts. Returns the reassembled files."""
    groups: dict[str, list[tuple[int, Path]]] = {}
    for path in directory.iterdir():
        match = _PART.match(path.name)
        if match and path.is_file():
            groups.setdefault(match["name"], []).append((int(match["index"]), path))
    if not groups:
        return []
    sums = read_sums(directory)
    joined = []
    for name, parts in sorted(groups.items()):
        parts.sort()
        indices = [index for index, _ in parts]
        if indices != list(range(len(parts))):
            raise ChunkError(f"{name}: chunk(s) missing (have {indices}): copy every {name}.part-* file")
        if name not in sums:
            raise ChunkError(f"{name} is not in {SUMS}: re-run the stager so it lists every file")
        target = directory / name
        with target.open("wb") as out:
            for _, part in parts:
                out.write(part.read_bytes())
        actual = sha256(target)
        if actual != sums[name]:
            target.unlink()
            raise ChunkError(
                f"{name}: SHA-256 {actual[:12]}... != {sums[name][:12]}... in {SUMS}: "
                "a chunk is corrupt or from another staging run; copy the chunks again"
            )
        for _, part in parts:
            part.unlink()
        joined.append(target)
    return joined


def plan_transfers(sizes: list[int], limit: int = TRANSFER_BYTES) -> int:
    """How many transfers of at most limit bytes carry files of these sizes (first fit,
    biggest first; a file is never split across transfers)."""
    bins: list[int] = []
    for size in sorted(sizes, reverse=True):
        if size > limit:
            raise ChunkError(f"a {size}-byte file exceeds one transfer ({limit} bytes): split it first")
        for index, used in enumerate(bins):
            if used + size <= limit:
                bins[index] += size
                break
        else:
            bins.append(size)
    return len(bins)


def describe(directory: Path, limit: int = TRANSFER_BYTES) -> str:
    sizes = [path.stat().st_size for path in directory.iterdir() if path.is_file()]
    total = sum(sizes)
    return (
        f"{directory}: {len(sizes)} files, {total / MIB:.1f} MiB in all, "
        f"{plan_transfers(sizes, limit)} transfer(s) of at most {limit / MIB:g} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("sums", "split", "join", "plan"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--max-mib", type=float, default=DEFAULT_MAX_BYTES / MIB)
    parser.add_argument("--transfer-mib", type=float, default=TRANSFER_BYTES / MIB)
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        print(f"error: {args.directory} is not a directory: pass the wheels folder", file=sys.stderr)
        return 2
    try:
        if args.action == "sums":
            print(write_sums(args.directory))
        elif args.action == "plan":
            print(describe(args.directory, int(args.transfer_mib * MIB)))
        elif args.action == "split":
            for piece in split_dir(args.directory, int(args.max_mib * MIB)):
                print(piece.name)
        else:
            for path in join(args.directory):
                print(f"joined {path.name}")
    except ChunkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
