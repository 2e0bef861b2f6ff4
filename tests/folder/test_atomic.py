"""artifacts.cache_dir: one place decides where every cache lives (PTX, demo model, benchmark exports)."""

from pathlib import Path

from andrea_export.folder.atomic import cache_dir


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("ANDREA_EXPORT_CACHE", raising=False)
    monkeypatch.delenv("ANDREA_PTX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("demo") == tmp_path / "xdg" / "andrea-export" / "demo"
    monkeypatch.setenv("ANDREA_EXPORT_CACHE", str(tmp_path / "mine"))
    assert cache_dir("bench") == tmp_path / "mine" / "bench"  # one root, a folder per kind: kinds never mix
    assert cache_dir("ptx", override="ANDREA_PTX_CACHE") == tmp_path / "mine" / "ptx"
    monkeypatch.setenv("ANDREA_PTX_CACHE", str(tmp_path / "ptx-only"))
    assert cache_dir("ptx", override="ANDREA_PTX_CACHE") == Path(tmp_path / "ptx-only")
