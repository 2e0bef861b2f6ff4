"""Crashes, interrupts and concurrent runs never lose a good build nor leave one that looks finished.

The pipeline's own steps are replaced by a stand-in that stages a "new build" (the tiny build's files,
each changed, the decoder left out) so that what is tested, the switch from the old build folder to the
new one, runs in well under a second per fault."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from andrea_export import pipeline
from andrea_export.errors import BuildError
from andrea_export.folder import atomic as artifacts
from andrea_export.folder.reader import changed_artifacts, read_manifest
from andrea_export.pipeline import BuildOptions, run_build

NEW_SEED = 7
REPO = Path(__file__).resolve().parents[1]


def stage_new_build(source: Path):
    """A stand-in for pipeline._build_into: every artifact of `source` except the decoder's, changed."""

    def build_into(tmp, out, opts, model, builder, profiles, timing_cache, evaluation):
        m = json.loads((source / "manifest.json").read_text())
        names = {role: a["path"] for role, a in m["artifacts"].items() if not role.startswith("decoder")}
        for name in names.values():
            (tmp / name).write_bytes((source / name).read_bytes() + b"new")
        return {**{k: v for k, v in m.items() if k != "artifacts"}, "options": __import__("dataclasses").asdict(opts),
                "artifacts": names}

    return build_into


def new_options(out: Path) -> BuildOptions:
    return BuildOptions(config="andrea-tiny", builder="tensorrt-rtx", out=str(out), seed=NEW_SEED, greedy_steps=4,
                        verify_shapes=[[1, 3], [2, 128]])


def complete_build(out: Path) -> int:
    """Assert `out` holds one complete build, and nothing else but its files; returns its seed."""
    m = read_manifest(out)
    assert changed_artifacts(out, m) == [], "a file does not match the manifest"
    files = {p.name for p in out.iterdir()}
    expected = {a["path"] for a in m["artifacts"].values()} | {"manifest.json", "build-config.toml"}
    assert files == expected, f"leftovers {files - expected}, missing {expected - files}"
    return m["options"]["seed"]


def no_leftovers(out: Path) -> None:
    """No staging or lock debris in the folder or beside it."""
    assert not [p for p in out.iterdir() if p.name.startswith(".")], list(out.iterdir())
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], list(out.parent.iterdir())


@pytest.fixture
def old_build(tiny_build, tmp_path):
    out = tmp_path / "parent" / "b"
    out.parent.mkdir()
    shutil.copytree(tiny_build[0], out)
    return out


# --- atomic writes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["write", "replace"])
def test_failed_atomic_write_keeps_the_old_file(tmp_path, monkeypatch, fault):
    target = tmp_path / "f.json"
    target.write_text("old")
    if fault == "write":  # the disk fills halfway through the new contents
        real_write = Path.write_bytes

        def write_bytes(self, data):
            real_write(self, data[:3])
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(Path, "write_bytes", write_bytes)
        error = OSError
    else:  # Ctrl-C just as the new file would take the old one's place
        def replace(*a):
            raise KeyboardInterrupt

        monkeypatch.setattr(os, "replace", replace)
        error = KeyboardInterrupt
    with pytest.raises(error):
        artifacts.write_text_atomic(target, "new contents")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


# --- a build folder switches from the old build to the new one in one step -------------------------


class Interrupt:
    """Raise KeyboardInterrupt at the n-th rename-like call (os.replace, os.rename, the folder exchange)."""

    def __init__(self, monkeypatch, n: int):
        self.n, self.calls = n, 0
        for mod, name in ((os, "replace"), (os, "rename"), (artifacts, "_exchange")):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, self.wrap(getattr(mod, name)))

    def wrap(self, real):
        def f(*a, **k):
            self.calls += 1
            if self.calls == self.n:
                raise KeyboardInterrupt
            return real(*a, **k)
        return f


def test_interrupt_at_each_rename_leaves_the_old_or_the_new_build(old_build, tiny_build, monkeypatch):
    monkeypatch.setattr(pipeline, "_build_into", stage_new_build(tiny_build[0]))
    seen = set()
    for n in range(1, 40):
        shutil.rmtree(old_build)
        shutil.copytree(tiny_build[0], old_build)
        with monkeypatch.context() as m:
            fault = Interrupt(m, n)
            try:
                run_build(new_options(old_build), force=True)
                finished = True
            except KeyboardInterrupt:
                finished = False
        seen.add(complete_build(old_build))  # the old build (seed 0) or the new one, complete
        run_build(new_options(old_build), force=True)  # a re-run finishes the job and cleans up
        assert complete_build(old_build) == NEW_SEED
        no_leftovers(old_build)
        if finished and fault.calls < n:
            break
    else:
        pytest.fail("the build has more rename points than the loop interrupts: widen the range")
    assert seen == {0, NEW_SEED}, "the faults never hit both sides of the switch"


def test_interrupted_verify_keeps_a_consistent_folder(old_build, monkeypatch):
    from andrea_export.verify import folder as verify_folder

    monkeypatch.setattr(verify_folder, "verify_folder", lambda *a, **k: _canned_report(old_build))
    before = read_manifest(old_build)
    interrupted = 0
    for n in range(1, 20):
        with monkeypatch.context() as m:
            fault = Interrupt(m, n)
            try:
                pipeline.verify_build(old_build)
                finished = True
            except KeyboardInterrupt:
                finished = False
                interrupted += 1
        assert complete_build(old_build) == 0
        no_leftovers(old_build)
        if finished and fault.calls < n:
            break
    else:
        pytest.fail("verify has more rename points than the loop interrupts: widen the range")
    assert interrupted, "no interrupt ever hit verify: the test checked nothing"
    after = read_manifest(old_build)
    assert after["verified_on"] and after["artifacts"]["onnx"] == before["artifacts"]["onnx"]


def _canned_report(folder: Path):
    from andrea_export.verify.compare import VerifyReport

    d = json.loads((folder / "verify.json").read_text())
    d["shapes"] = d["shapes"] + [[9, 9]]  # a new report: different bytes from the old one
    return VerifyReport(**d)


def test_failed_fresh_build_leaves_no_folder(tmp_path, monkeypatch):
    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline, "_build_into", disk_full)
    out = tmp_path / "x" / "y" / "fresh"
    with pytest.raises(BuildError, match="no space left"):
        run_build(new_options(out))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(pipeline, "_build_into", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        run_build(new_options(out))
    assert list(tmp_path.iterdir()) == []


# --- other processes: kill -9 and a second build at the same time -----------------------------------

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_crash_safety import stage_new_build, new_options
    from andrea_export import pipeline
    from andrea_export.folder import atomic as artifacts

    out, source, kill_at, gate = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    build_into = stage_new_build(source)

    def slow_build_into(*a):
        (gate / "started").touch()
        while not (gate / "go").exists():
            time.sleep(0.05)
        return build_into(*a)

    pipeline._build_into = slow_build_into
    calls = [0]
    for mod, name in ((os, "replace"), (os, "rename"), (artifacts, "_exchange")):
        if hasattr(mod, name):
            real = getattr(mod, name)
            def f(*a, _real=real, **k):
                calls[0] += 1
                if calls[0] == kill_at:  # before the call
                    os.kill(os.getpid(), signal.SIGKILL)
                result = _real(*a, **k)
                if calls[0] == -kill_at:  # after it
                    os.kill(os.getpid(), signal.SIGKILL)
                return result
            setattr(mod, name, f)
    pipeline.run_build(new_options(out), force=True)
""")


def _start(tmp_path, out: Path, source: Path, kill_at: int):
    gate = tmp_path / f"gate{kill_at}"
    gate.mkdir()
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(source), str(kill_at), str(gate)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (gate / "started").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the build process did not start"
        time.sleep(0.05)
    return proc, gate


@pytest.mark.parametrize("kill_at", [2, -3], ids=["before-switch", "after-switch"])
def test_kill_9_mid_build_then_a_rerun_cleans_up(old_build, tiny_build, tmp_path, monkeypatch, kill_at):
    proc, gate = _start(tmp_path, old_build, tiny_build[0], kill_at=kill_at)
    (gate / "go").touch()
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read()
    assert complete_build(old_build) in (0, NEW_SEED)
    monkeypatch.setattr(pipeline, "_build_into", stage_new_build(tiny_build[0]))
    run_build(new_options(old_build), force=True)
    assert complete_build(old_build) == NEW_SEED
    no_leftovers(old_build)


def test_a_second_build_into_the_same_folder_is_refused(old_build, tiny_build, tmp_path, monkeypatch):
    proc, gate = _start(tmp_path, old_build, tiny_build[0], kill_at=0)
    try:
        monkeypatch.setattr(pipeline, "_build_into", stage_new_build(tiny_build[0]))
        with pytest.raises(BuildError, match="in use by another andrea-export run"):
            run_build(new_options(old_build), force=True)
        with pytest.raises(BuildError, match="in use by another andrea-export run"):
            pipeline.verify_build(old_build)
        from click.testing import CliRunner

        from andrea_export.cli import main

        r = CliRunner().invoke(main, ["package", str(old_build), "--triton", str(tmp_path / "repo"),
                                      "--backend", "onnxruntime", "--kind", "cpu"])
        assert r.exit_code == 1 and "is in use by another andrea-export run" in " ".join(r.output.split()), r.output
        assert not (tmp_path / "repo").exists()
    finally:
        (gate / "go").touch()
        proc.wait(timeout=120)
    assert proc.returncode == 0, proc.stdout.read()
    assert complete_build(old_build) == NEW_SEED
    no_leftovers(old_build)


def test_staging_folders_of_dead_runs_are_removed(tmp_path):
    """An export killed mid-write leaves `.staging-*.partial` beside its file: the next write into that
    folder removes it, unless a live run holds it or it is too young to tell."""
    import fcntl

    dead, young, live = (tmp_path / f".staging-{n}.partial" for n in ("dead", "young", "live"))
    for d in (dead, young, live):
        d.mkdir()
        (d / "model.onnx").write_bytes(b"half")
    os.utime(dead, (time.time() - 3600,) * 2)
    os.utime(live, (time.time() - 3600,) * 2)
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as its owner holds it
    try:
        with artifacts.staging(tmp_path) as tmp:
            (tmp / "x.onnx").write_bytes(b"x")
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging-live.partial", ".staging-young.partial", "x.onnx"]
