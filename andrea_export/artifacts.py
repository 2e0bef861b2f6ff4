"""Writing artifacts safely: write under a temporary name, rename when complete, so a failure or
Ctrl-C never leaves a file that looks finished. Plus sha256 for manifests."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK  # what open() would give; mkstemp's 0600 would hide artifacts from other users


@contextlib.contextmanager
def atomic_path(final: str | Path):
    """Yield a temporary path beside `final`; on success rename it to `final`, on any error remove it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
    os.fchmod(fd, _FILE_MODE)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def staging(dest: str | Path, marker_suffix: str = ".onnx"):
    """Yield a hidden temporary folder inside `dest`; when the block succeeds its files move into `dest`,
    those ending in `marker_suffix` last (the file a user looks for appears only when all else is there).
    On any error the folder is removed and `dest` is left as it was."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".staging-", suffix=".partial", dir=dest))
    try:
        yield tmp
        for f in sorted(tmp.iterdir(), key=lambda p: p.name.endswith(marker_suffix)):
            os.replace(f, dest / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode())


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
