"""Writing artifacts safely: write under a temporary name, rename when complete, so a failure or
Ctrl-C never leaves a file that looks finished. A folder of artifacts (a build) is updated as a whole:
staged beside it and swapped in by one rename, under a lock. Plus sha256 for manifests."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..errors import BuildError

_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK  # what open() would give; mkstemp's 0600 would hide artifacts from other users


def cache_dir(kind: str, override: str | None = None) -> Path:
    """The project's on-disk cache for `kind` (ptx, demo, bench, ...): $<override> when that variable is set,
    else $ANDREA_EXPORT_CACHE/<kind>, else $XDG_CACHE_HOME (or ~/.cache)/andrea-export/<kind>."""
    if override and os.environ.get(override):
        return Path(os.environ[override])
    if os.environ.get("ANDREA_EXPORT_CACHE"):
        return Path(os.environ["ANDREA_EXPORT_CACHE"]) / kind
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "andrea-export" / kind


@contextlib.contextmanager
def atomic_path(final: str | Path):
    """Yield a temporary path beside `final`; on success rename it to `final`, on any error remove it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
    os.fchmod(fd, _FILE_MODE)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _FILE_MODE)  # a writer that replaces the file (safetensors does) brings its own 0600
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def staging(dest: str | Path, marker_suffix: str = ".onnx"):
    """Yield a hidden temporary folder inside `dest`; when the block succeeds its files move into `dest`,
    those ending in `marker_suffix` last (the file a user looks for appears only when all else is there).
    On any error the folder is removed and `dest` is left as it was (folders made for it removed too).
    Staging folders of dead processes (kill -9) found there are removed first."""
    dest = Path(dest)
    with _made_dirs(dest):
        tmp = _new_staging(dest, ".staging-", grace=60)
        try:
            yield tmp
            for f in sorted(tmp.iterdir(), key=lambda p: p.name.endswith(marker_suffix)):
                os.replace(f, dest / f.name)
        finally:
            _release(tmp)
            shutil.rmtree(tmp, ignore_errors=True)


# --- a folder updated as one step -----------------------------------------------------------------
#
# A build folder holds files that only make sense together (the manifest records every file's sha256).
# It is never changed file by file: the new state is staged in a sibling folder `.<name>.staging-*.partial`
# (unchanged files hard-linked), then swapped with the folder by one renameat2(RENAME_EXCHANGE), so a
# crash at any instant leaves the old folder or the new one, complete. The folder is locked (flock on the
# folder itself) from the first read to the swap; each staging folder is locked by its owner, so one that
# can be locked belongs to a dead process and is removed.


def _lock(fd: int, shared: bool = False) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _new_staging(parent: Path, prefix: str, grace: float = 0.0) -> Path:
    """A new locked staging folder in `parent`, after removing the stale ones with this prefix. `grace`:
    spare those younger than this many seconds (where no lock keeps another run from creating one in the
    instant between its mkdtemp and its flock)."""
    now = time.time()
    for p in parent.iterdir():
        if not (p.name.startswith(prefix) and p.name.endswith(".partial")) or p.is_symlink() or not p.is_dir():
            continue
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime < grace:
                continue
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if _lock(fd):  # nobody holds it: its owner died mid-write
                    shutil.rmtree(p, ignore_errors=True)
            finally:
                os.close(fd)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".partial", dir=parent))
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    _lock(fd)
    _HELD[tmp] = fd  # closed (unlocked) by the process exit or _release
    return tmp


_HELD: dict[Path, int] = {}


def _release(path: Path) -> None:
    fd = _HELD.pop(path, None)
    if fd is not None:
        os.close(fd)


@contextlib.contextmanager
def _made_dirs(folder: Path):
    """Create `folder` and its missing parents; remove those it created if the block fails."""
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for p in missing:  # deepest first; a folder someone else filled meanwhile stays
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


@contextlib.contextmanager
def locked_folder(folder: str | Path, shared: bool = False, create: bool = False):
    """Hold a lock on `folder` (exclusive, or shared for readers) for the block; refuse with BuildError
    when another run holds it. `create`: make the folder (and parents) if missing; removed again if the
    block fails and it is still empty. The lock follows the folder across `update_folder`'s swap."""
    folder = Path(folder)
    with _made_dirs(folder) if create else contextlib.nullcontext():
        while True:
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            except (FileNotFoundError, NotADirectoryError):
                raise BuildError(f"{folder}: no such folder") from None
            if not _lock(fd, shared):
                os.close(fd)
                raise BuildError(f"{folder} is in use by another andrea-export run (a build, verify or package); "
                                 "wait for it to finish, or choose another folder")
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(folder))
            except FileNotFoundError:
                same = False
            if same:  # not swapped away while we waited for it
                break
            os.close(fd)
        try:
            yield folder
        finally:
            os.close(fd)


@contextlib.contextmanager
def update_folder(folder: str | Path, drop: "set[str] | frozenset[str]" = frozenset()):
    """Replace the contents of the locked `folder` (see locked_folder) in one step: yield an empty staging
    folder beside it; when the block succeeds, every entry of `folder` the block did not write and that is
    not named in `drop` is hard-linked into it, and it is swapped with `folder`. On any error, or an
    interrupt, `folder` is left exactly as it was and the staging folder is removed."""
    folder = Path(folder)
    real = Path(os.path.realpath(folder))  # a symlinked folder: swap its target, keep the link
    try:
        tmp = _new_staging(real.parent, f".{real.name}.staging-")
    except OSError as e:
        raise BuildError(f"cannot update {folder}: {e.strerror} ({e.filename})") from None
    try:
        yield tmp
        for entry in real.iterdir():
            if entry.name in drop or (tmp / entry.name).exists() or entry.name.endswith(".partial"):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, tmp / entry.name, copy_function=_link_or_copy, symlinks=True)
            else:
                _link_or_copy(entry, tmp / entry.name)
        if any(real.iterdir()):
            swap_folders(tmp, real)
        else:
            os.rename(tmp, real)  # replaces an empty folder
    finally:
        _release(tmp)
        shutil.rmtree(tmp, ignore_errors=True)  # the staging, or after the swap the old contents


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # links not allowed here: copy
        shutil.copy2(src, dst, follow_symlinks=False)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def swap_folders(new: Path, folder: Path) -> None:
    """`folder` gets `new`'s contents and `new` the old ones, in one step where the system allows."""
    try:
        _exchange(new, folder)
        return
    except AttributeError:  # no renameat2 in this C library
        pass
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    # No atomic exchange on this system or file system: two renames, undone if the second fails. A crash
    # between them leaves no folder, and the old one under `aside` (left for the user: not a staging name).
    aside = folder.with_name(f".{folder.name}.previous-{os.getpid()}")
    os.rename(folder, aside)
    try:
        os.rename(new, folder)
    except BaseException:
        os.rename(aside, folder)
        raise
    os.rename(aside, new)


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
