"""Paths as they are recorded in what hispec writes (manifests, results, reports).

A file written on one machine must not carry that machine's folders: a path inside the
current directory (the repository, when run from its root) is recorded relative to it; a
file elsewhere is recorded by its name and a hash of its contents (enough to recognise the
same data on another machine); anything that is not a local path (``sharegpt``, ``default``,
a model name) is recorded as given.
"""
from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

HASH_CHARS = 12  # hex digits of sha256 kept: enough to tell data files apart


def file_digest(path: Path) -> str:
    """The first ``HASH_CHARS`` hex digits of the sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:HASH_CHARS]


def _inside_cwd(path: Path) -> str | None:
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix() or "."
    except ValueError:
        return None


def portable(value: str | Path | None, *, digest: bool = True) -> str | None:
    """How a user-given path is recorded: relative to the current directory when inside it,
    else ``NAME#sha256:HEX`` for a file (``NAME`` for a folder, or with ``digest=False``);
    values that are not existing local paths come back unchanged (absolute ones by name only)."""
    if value is None:
        return None
    text = str(value)
    path = Path(text).expanduser()
    if not path.exists():
        return path.name if path.is_absolute() else text
    rel = _inside_cwd(path)
    if rel is not None:
        return rel
    if digest and path.is_file():
        return f"{path.name}#sha256:{file_digest(path)}"
    return path.name


def portable_command(argv: list[str]) -> str:
    """A command line with every local path made portable (file names, no hashes: it stays
    a command a reader can retype with their own copy of the data)."""
    return " ".join(shlex.quote(portable(a, digest=False)) for a in argv)
