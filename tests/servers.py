"""What the servers' tests share: the serving environment they need, and the processes a test run leaves behind
(each process whose environment carries the run's mark, MARK=token, which every child inherits, read from /proc:
Linux, where Triton runs)."""

import os
import signal
from pathlib import Path

import pytest

MARK = "ANDREA_EXPORT_TEST_RUN"
WATCHED = ("tritonserver", "triton_python_backend_stub")


def marked(token: str, names: tuple[str, ...] = WATCHED) -> list[tuple[int, str, int]]:
    """(pid, name, parent pid) of each live process named in `names` whose environment has MARK=token (zombies
    hold no memory and have no environment left to read: not counted)."""
    want, found = f"{MARK}={token}".encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            name = Path((entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")).name
            if name not in names or want not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
        found.append((int(entry.name), name, ppid))
    return found


def kill(processes: list[tuple[int, str, int]]) -> None:
    for pid, _, _ in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def needs_serving_env() -> None:
    """Skips the test where `make serve-env` has not made the serving environment (CI makes it)."""
    from andrea_export.deploy import server

    try:
        server.triton_dist(server.serve_python())
    except server.ServeError as e:
        pytest.skip(f"no serving environment here ({e}); `make serve-env` makes it (CI does)")


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == pid and alive(int(p))]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
