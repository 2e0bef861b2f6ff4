"""Hostile and careless input, through the CLI: a build folder is something people download and share,
and a checkpoint's or an ONNX file's metadata is whatever its author wrote. Every case asserts the same
contract: no traceback, the documented exit code, a message that names the problem, nothing outside
the build folder created or deleted (a sentinel file and the listing of the folder around it), and a
good build beside it left byte-identical.

One tiny build is made per module and copied for each case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from andrea_export.cli import main
from andrea_export.config import ANDREA_TINY

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX (the 'rtx' extra) builds the engines on a CPU")

TINY_BUILD = ["--config", "andrea-tiny", "--builder", "tensorrt-rtx"]
try:
    TRITON = bool(importlib.import_module("tritonclient.grpc.model_config_pb2"))  # the 'triton' extra: `package`
except ImportError:
    TRITON = False


@pytest.fixture(scope="module")
def tiny_build_src(tmp_path_factory):
    from andrea_export.pipeline import BuildOptions, run_build

    out = tmp_path_factory.mktemp("hostile-src") / "tiny"
    run_build(BuildOptions(config="andrea-tiny", builder="tensorrt-rtx", out=str(out), greedy_steps=2,
                           verify_shapes=[[1, 3]]))
    return out


@dataclasses.dataclass
class Scene:
    """A work area: `good` (an intact build, never to change), `evil` (a copy to tamper with), a
    sentinel file, all under `root`."""

    root: Path
    good: Path
    evil: Path
    sentinel: Path

    def manifest(self) -> dict:
        return json.loads((self.evil / "manifest.json").read_text())

    def write_manifest(self, m: dict) -> None:
        (self.evil / "manifest.json").write_text(json.dumps(m, indent=2))


@pytest.fixture
def scene(tiny_build_src, tmp_path, monkeypatch):
    root = tmp_path / "area"
    (root / "work").mkdir(parents=True)
    good, evil = root / "good", root / "work" / "evil"
    shutil.copytree(tiny_build_src, good)
    shutil.copytree(tiny_build_src, evil)
    sentinel = root / "sentinel.txt"
    sentinel.write_text("must survive\n")
    monkeypatch.chdir(root / "work")
    return Scene(root, good, evil, sentinel)


def _snapshot(root: Path, skip: Path | None) -> dict[str, str]:
    """{relative path: sha256 (or 'dir')} of everything under root, `skip` (the attacked folder) left out."""
    out = {}
    for p in sorted(root.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        out[p.relative_to(root).as_posix()] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@contextlib.contextmanager
def untouched(scene: Scene, inside: Path | None = None):
    """Nothing under scene.root changes except inside `inside` (default: the evil build)."""
    inside = scene.evil if inside is None else inside
    before = _snapshot(scene.root, inside)
    yield
    after = _snapshot(scene.root, inside)
    assert scene.sentinel.read_text() == "must survive\n"
    assert after == before, {"created": sorted(set(after) - set(before)), "deleted": sorted(set(before) - set(after)),
                             "changed": sorted(k for k in before.keys() & after.keys() if before[k] != after[k])}


def cli(*args: str, code: int = 1, says: str | tuple[str, ...] = ()) -> str:
    """Run the CLI in-process; assert no traceback, the exit code, and the words of the message."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    out = result.output
    assert "Traceback" not in out, out
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {type(result.exception).__name__}: {result.exception}\n{out}")
    assert result.exit_code == code, out
    for word in (says,) if isinstance(says, str) else says:
        assert word in out, out
    if code == 1:
        assert "error:" in out, out
    return out


def flip_one_byte(path: Path, offset: int | None = None) -> None:
    """Change one byte in place: same size, different sha256 (a size check alone misses it)."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    size = path.stat().st_size
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size


# ---- security: nothing outside the folder ----------------------------------------------------------------


def test_crafted_manifest_cannot_make_build_delete_outside_files(scene):
    """Issue 10 repro: a rebuild deleted the old manifest's leftovers by their recorded path."""
    from andrea_export.pipeline import BuildOptions

    victim, victim2 = scene.root / "victim.txt", scene.evil.parent / "victim2.txt"
    victim.write_text("victim\n")
    victim2.write_text("victim2\n")
    m = scene.manifest()
    m["options"] = dataclasses.asdict(BuildOptions(config="andrea-tiny", builder="tensorrt-rtx", out="evil"))
    m["artifacts"]["x"] = {"path": str(victim), "sha256": "0" * 64, "bytes": 7}
    m["artifacts"]["y"] = {"path": "../victim2.txt", "sha256": "0" * 64, "bytes": 8}
    scene.write_manifest(m)
    with untouched(scene):
        cli("build", *TINY_BUILD, "--out", "evil", says=("manifest.json", "outside"))
    assert victim.read_text() == "victim\n" and victim2.read_text() == "victim2\n"


@pytest.mark.parametrize("path", ["/etc/hostname", "../victim2.txt", "sub/../../victim2.txt", "", ".", "a\x00b"])
def test_manifest_paths_must_stay_inside_the_folder(scene, path):
    (scene.evil.parent / "victim2.txt").write_text("victim2\n")
    m = scene.manifest()
    m["artifacts"]["onnx"]["path"] = path
    scene.write_manifest(m)
    with untouched(scene):
        for command in (["inspect", scene.evil], ["verify", scene.evil], ["generate", scene.evil, "--prompt-ids", "1"],
                        ["build", *TINY_BUILD, "--out", scene.evil, "--force"]):
            cli(*command, says="manifest.json")


def test_a_symlinked_artifact_pointing_outside_is_refused(scene):
    target = scene.root / "outside.onnx"
    shutil.copyfile(scene.evil / "decoder.onnx", target)
    (scene.evil / "decoder.onnx").unlink()
    (scene.evil / "decoder.onnx").symlink_to(target)
    with untouched(scene):
        cli("generate", scene.evil, "--prompt-ids", "1,2", says=("decoder.onnx", "outside"))


def _tiny_config_json(path: Path, name: str) -> Path:
    path.write_text(json.dumps({**ANDREA_TINY.to_dict(), "name": name}))
    return path


@pytest.mark.parametrize("name", ["../../escape", "a/b", "/abs", "..", ".hidden", "x" * 129, "a\\b", "", "tab\tname"])
def test_a_model_name_cannot_steer_the_output_folder(scene, name):
    cfg = _tiny_config_json(scene.root / "evil.json", name)
    with untouched(scene, inside=scene.root / "work" / "out"):
        cli("build", "--config", cfg, "--builder", "tensorrt-rtx", says=("name",))
    assert not (scene.root / "work" / "out").exists()


def test_a_checkpoint_name_cannot_steer_the_output_folder(scene):
    from safetensors.torch import save_file

    from andrea_export.model.checkpoint import random_init

    model = random_init(ANDREA_TINY, announce=False)
    ckpt = scene.root / "w.safetensors"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(ckpt), metadata={"andrea.config": json.dumps({**ANDREA_TINY.to_dict(), "name": "../../escape"})})
    with untouched(scene, inside=scene.root / "work" / "out"):
        cli("build", "--checkpoint", ckpt, "--builder", "tensorrt-rtx", says=("andrea.config", "name"))


def test_a_toml_cannot_aim_the_build_elsewhere(scene):
    """A build-config.toml sits in the build it repeats: the paths a build writes to stay in that folder."""
    toml = scene.evil / "build-config.toml"
    for key, value in (("out", str(scene.root / "elsewhere")), ("timing_cache", "../x.cache")):
        keep = [line for line in toml.read_text().splitlines(True) if not line.startswith(("out =", f"{key} ="))]
        out = "" if key == "out" else f"out = {json.dumps(str(scene.evil))}\n"
        toml.write_text("".join(keep) + out + f"{key} = {json.dumps(value)}\n")
        with untouched(scene):
            cli("build", "--build-config", toml, says=(key, "outside the folder of this file"))


# ---- a build folder's files: tampered in place ------------------------------------------------------------


# what generate reads, per backend (a build with the in-place decoder, which ONNX Runtime on the CPU runs)
READS = {"tensorrt": {"decoder.onnx", "decoder.plan", "decoder.plan.json", "weights.fp32.data"},
         "onnxruntime": {"decoder.inplace.onnx", "weights.fp32.data"}}


@pytest.mark.parametrize("victim", ["model.onnx", "decoder.onnx", "decoder.inplace.onnx", "decoder.plan", "decoder.plan.json",
                                    "model.plan.json", "weights.fp32.data"])
def test_one_flipped_byte_is_caught_by_every_command(scene, victim):
    """Same size, one byte different: only the sha256 tells (a size check alone must not be enough)."""
    flip_one_byte(scene.evil / victim)
    with untouched(scene):
        cli("inspect", scene.evil, says=("CHANGED", victim))
        cli("verify", scene.evil, says=(victim, "changed since the build"))
        # generate checks every file the chosen backend reads (TensorRT's before TensorRT or the missing GPU
        # is looked at), and hashes no other: ONNX Runtime runs beside a changed engine or standard graph
        for backend, reads in READS.items():
            if victim in reads:
                cli("generate", scene.evil, "--prompt-ids", "1,2", "--backend", backend, says=(victim, "changed since the build"))
            elif backend == "onnxruntime" and victim.startswith("decoder"):
                cli("generate", scene.evil, "--prompt-ids", "1,2", "--backend", backend, code=0)
    if victim in ("model.onnx", "weights.fp32.data"):  # package copies the graph and the weights it points into
        pytest.importorskip("tritonclient.grpc.model_config_pb2")
        with untouched(scene, inside=scene.root / "repo"):
            cli("package", scene.evil, "--triton", scene.root / "repo", "--kind", "cpu", says=(victim, "sha256"))
        assert not (scene.root / "repo").exists() or not any((scene.root / "repo").iterdir())


def test_inspect_plan_checks_the_sidecar_hash(scene):
    plan = scene.evil / "model.plan"
    cli("inspect", plan, code=0, says="matches the sha256 in model.plan.json")
    plan.write_bytes(os.urandom(plan.stat().st_size))  # random bytes of the recorded size
    with untouched(scene):
        out = cli("inspect", plan, says=("CHANGED", "model.plan"))
    assert "matches the sha256" not in out


@pytest.mark.parametrize("sidecar", ["not json {", "[]", '{"builder": "tensorrt-rtx"}', '{"builder": "x", "builder_version": 1}'])
def test_garbage_engine_sidecar(scene, sidecar):
    (scene.evil / "model.plan.json").write_text(sidecar)
    with untouched(scene):
        cli("inspect", scene.evil / "model.plan", says="model.plan.json")
    # the same garbage with the manifest re-hashed to match, as an attacker would: still refused, clearly
    m = scene.manifest()
    data = (scene.evil / "model.plan.json").read_bytes()
    m["artifacts"]["engine_info"] |= {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    scene.write_manifest(m)
    with untouched(scene):
        cli("verify", scene.evil, says="model.plan.json")


def test_manifest_symlink_to_elsewhere(scene):
    outside = scene.root / "manifest-elsewhere.json"
    shutil.move(scene.evil / "manifest.json", outside)
    (scene.evil / "manifest.json").symlink_to(outside)
    with untouched(scene):
        for command in (["inspect", scene.evil], ["generate", scene.evil, "--prompt-ids", "1"]):
            cli(*command, says=("manifest.json", "outside"))


@pytest.mark.parametrize("version", [2, "1", True, None, 1.0])
def test_schema_version_is_checked_by_every_command(scene, version):
    m = scene.manifest()
    m["schema_version"] = version
    scene.write_manifest(m)
    with untouched(scene):
        for command in (["inspect", scene.evil], ["verify", scene.evil], ["generate", scene.evil, "--prompt-ids", "1"],
                        ["build", *TINY_BUILD, "--out", scene.evil, "--force"]):
            cli(*command, says="schema_version")


# ---- malformed manifests, generated --------------------------------------------------------------------

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                     max_leaves=6)
_FIELDS = ["schema_version", "status", "model", "model.name", "model.vocab_size", "weights", "weights.kind",
           "weights.seed", "precision", "builder", "builder.name", "builder.compute_capabilities", "profiles",
           "plugin", "verification", "verification.skipped", "options", "artifacts", "artifacts.decoder_onnx",
           "artifacts.decoder_onnx.path", "artifacts.decoder_onnx.sha256", "artifacts.decoder_onnx.bytes",
           "artifacts.engine_info.path"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(_FIELDS), value=_json | st.sampled_from(["../x", "/etc/hostname", "decoder.plan"]))
@example(field="options", value=None)  # package reads options.max_slots: a null there is no dict
def test_any_malformed_manifest_is_one_clear_error(scene, field, value):
    """Replace one field of a good manifest by any JSON value: every command either works (the value was
    harmless) or says what is wrong in one line; never a traceback, never a file touched outside."""
    good = (scene.evil / "manifest.json").read_text()
    try:
        m = json.loads(good)
        *parents, last = field.split(".")
        node = m
        for p in parents:
            node = node[p]
        node[last] = value
        scene.write_manifest(m)
        commands = [["inspect", scene.evil], ["generate", scene.evil, "--prompt-ids", "1", "-n", "1"]]
        if TRITON:  # the repository goes inside the attacked folder: anything outside must stay as it was
            commands.append(["package", scene.evil, "--triton", scene.evil / "repo", "--kind", "cpu", "--overwrite"])
        with untouched(scene):
            for command in commands:
                result = CliRunner().invoke(main, [str(a) for a in command])
                assert result.exit_code in (0, 1), result.output
                assert result.exception is None or isinstance(result.exception, SystemExit), result.output
                assert "Traceback" not in result.output
                if result.exit_code == 1:
                    assert "error:" in result.output
    finally:
        (scene.evil / "manifest.json").write_text(good)


# ---- metadata: checkpoints and ONNX files are what their authors wrote ---------------------------------------


def _with_metadata(src: Path, dst: Path, **meta: str) -> Path:
    import onnx

    model = onnx.load(str(src))
    props = {p.key: p.value for p in model.metadata_props} | meta
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(dst))
    return dst


@pytest.mark.parametrize("key,value,says", [
    ("andrea.config", "not json", "andrea.config"),
    ("andrea.config", json.dumps({**ANDREA_TINY.to_dict(), "name": "../x"}), "name"),
    ("andrea.config", "[1, 2]", "JSON object"),
    ("andrea.weights", "{not json", "andrea.weights"),
    ("andrea.weights", "[]", "weight source"),
    ("andrea.weights", '{"kind": "random-init"}', "seed"),
    ("andrea.weights", '{"kind": "random-init", "seed": "0"}', "seed"),
    ("andrea.weights", '{"kind": "random-init", "seed": 18446744073709551616}', "seed"),  # over torch's 64 bits
    ("andrea.weights", '{"kind": "pickle"}', "kind"),
    ("andrea.weights", "[" * 100_000 + "]" * 100_000, "nests deeper"),  # json.loads: a RecursionError's traceback
])
def test_bad_onnx_metadata(scene, key, value, says):
    bad = _with_metadata(scene.evil / "model.onnx", scene.root / "bad.onnx", **{key: value})
    with untouched(scene, inside=scene.root / "bad.onnx.verify.json"):
        cli("verify", bad, "--shapes", "1x2", "--greedy-steps", "1", says=("bad.onnx", says))


@pytest.mark.parametrize("key,value,says", [
    ("andrea.kv_layout", "{not json", "andrea.kv_layout"),
    ("andrea.kv_layout", "[]", "KV layout"),
    ("andrea.config", json.dumps({**ANDREA_TINY.to_dict(), "name": "a/b"}), "name"),
    ("andrea.weights", '{"kind": "checkpoint", "sha256": 5}', "sha256"),
    ("andrea.kv_layout", '{"a": ' * 100_000 + "1" + "}" * 100_000, "nests deeper"),
])
def test_bad_decoder_metadata(scene, key, value, says):
    folder = scene.root / "dec"
    folder.mkdir()
    _with_metadata(scene.evil / "decoder.onnx", folder / "decoder.onnx", **{key: value})
    with untouched(scene):
        cli("generate", folder, "--prompt-ids", "1,2", "-n", "1", says=("decoder.onnx", says))


def test_a_foreign_onnx_with_copied_metadata(scene):
    """Metadata can be copied onto any graph: the graph's own signature is checked before anything runs."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    foreign = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "foreign", [x], [y]),
                                opset_imports=[helper.make_opsetid("", 20)])
    onnx.save(foreign, str(scene.root / "foreign.onnx"))
    meta = {p.key: p.value for p in onnx.load(str(scene.evil / "model.onnx"), load_external_data=False).metadata_props}
    copied = _with_metadata(scene.root / "foreign.onnx", scene.root / "copied.onnx", **meta)
    from andrea_export.model.checkpoint import random_init, save_checkpoint

    ckpt = save_checkpoint(random_init(ANDREA_TINY, announce=False), scene.root / "w.safetensors")
    with untouched(scene, inside=scene.root / "copied.onnx.verify.json"):
        cli("verify", copied, says=("copied.onnx", "not this model's graph"))
    with untouched(scene, inside=scene.root / "foreign.onnx.verify.json"):
        cli("verify", scene.root / "foreign.onnx", "--checkpoint", ckpt, "--config", "andrea-tiny",
            says=("foreign.onnx", "not this model's graph"))


def test_checkpoint_names_odd_file_names_and_umask(scene):
    from andrea_export.model.checkpoint import load_checkpoint, random_init, save_checkpoint

    old = os.umask(0o022)
    try:
        path = save_checkpoint(random_init(ANDREA_TINY, announce=False), scene.root / "w.safetensors")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644  # the umask's, not mkstemp's or safetensors' 0600

    from safetensors.torch import save_file

    model = random_init(ANDREA_TINY, announce=False)
    gpt2 = {k: (v.t().contiguous() if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else v.contiguous())
            for k, v in model.state_dict().items()}
    weird = scene.root / "model[v2] :b: ..safetensors"
    save_file(gpt2, str(weird))
    cfg = ANDREA_TINY.__class__(**{**ANDREA_TINY.to_dict(), "name": "x"})
    assert load_checkpoint(weird, cfg).cfg.name == "x"


# ---- messages: user text printed as it is --------------------------------------------------------------------


@pytest.mark.parametrize("text", ["[/x]", "model[v2].json", ":b:", "[bold]loud[/bold]", "[gpu]"])
def test_user_text_is_never_markup(scene, text):
    out = cli("export", "--config", text, "--out", scene.root / "m.onnx", says=f"no model config '{text}'")
    assert "🅱" not in out and "MarkupError" not in out
    out = cli("export", "--checkpoint", scene.root / f"{text}.safetensors", "--out", scene.root / "m.onnx",
              says=f"{text}.safetensors: no such checkpoint file")


def test_install_hints_keep_their_extras(capsys):
    from andrea_export.errors import MissingDependency
    from andrea_export.progress import error, warn

    error(str(MissingDependency("pip install 'andrea-export[gpu]' or 'andrea-export[tensorrt]' or [text]")))
    warn("a [bold]name[/bold] with :b:")
    err = capsys.readouterr().err
    assert "pip install 'andrea-export[gpu]' or 'andrea-export[tensorrt]' or [text]" in err
    assert "a [bold]name[/bold] with :b:" in err


# ---- honest messages -----------------------------------------------------------------------------------------


def test_tensorrt_backend_without_a_gpu_says_so(scene):
    from andrea_export.errors import gpu_compute_capability

    if gpu_compute_capability() is not None:
        pytest.skip("this machine has a GPU: the message is for machines without one")
    cli("generate", scene.evil, "--prompt-ids", "1,2", "--backend", "tensorrt", says=("no GPU", "--backend onnxruntime"))


def test_generate_announces_random_weights(scene):
    out = cli("generate", scene.evil, "--prompt-ids", "1,2", "-n", "2", code=0, says="RANDOM weights")
    assert "meaningless" in out


def test_sidecars_name_the_final_files_and_the_real_targets(scene):
    info = json.loads((scene.evil / "model.plan.json").read_text())
    assert info["plan"] == "model.plan" and info["onnx"] == "model.onnx"
    assert info["layer_report"] in (None, "model.layers.json")
    assert ".staging" not in (scene.evil / "model.plan.json").read_text()
    assert ".staging" not in (scene.evil / "decoder.plan.json").read_text()
    reasons = [s["reason"] for s in scene.manifest()["verification"]["skipped"]]
    from andrea_export.errors import gpu_compute_capability

    if gpu_compute_capability() is None:
        assert reasons and all("8.0, 8.6, 8.9, 12.0" in r and "7.5" not in r for r in reasons), reasons


def test_the_good_build_is_still_good(scene, tiny_build_src):
    """Every case above worked on copies: the source build is intact, and says so."""
    cli("inspect", tiny_build_src, code=0, says="every artifact matches its sha256")


# ---- the two guards, for any input ---------------------------------------------------------------------

_path_text = st.lists(st.sampled_from(["a", "b", ".", "..", "/", "\\", "\x00", " ", "-", "_", "~", "ab"]),
                      max_size=8).map("".join)


@settings(max_examples=300, deadline=None)
@given(name=_path_text | st.text(max_size=80))
def test_inside_never_lets_a_path_out(tmp_path_factory, name):
    from andrea_export.errors import BuildError
    from andrea_export.folder.reader import inside

    folder = tmp_path_factory.getbasetemp() / "inside-prop" / "build"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        path = inside(folder, name, "test")
    except BuildError:
        return
    assert folder.resolve() in path.resolve().parents


@settings(max_examples=300, deadline=None)
@given(name=_path_text | st.text(max_size=80))
def test_a_model_name_is_one_safe_path_component(name):
    from andrea_export.config import ModelConfig, check_name, safe_name
    from andrea_export.errors import ConfigError

    check_name(safe_name(name))  # a checkpoint's file name always makes a usable name
    try:
        cfg = ModelConfig.from_dict({**ANDREA_TINY.to_dict(), "name": name})
    except ConfigError as e:
        assert "'name'" in str(e)
        return
    out = Path("out") / f"{cfg.name}-fp32"
    assert len(out.parts) == 2 and out.parent == Path("out") and not out.name.startswith(".")


# ---- a shared build-config.toml: reads nothing outside its folder -------------------------------------------


def _toml_with(scene: Scene, **values) -> Path:
    toml = scene.evil / "build-config.toml"
    keep = [line for line in toml.read_text().splitlines(True) if line.split(" =")[0] not in values]
    toml.write_text("".join(keep) + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return toml


@pytest.mark.parametrize("key", ["tokenizer", "eval_text", "checkpoint", "config"])
def test_a_toml_reads_no_file_outside_its_folder(scene, key):
    """eval_text = "~/.ssh/id_rsa" would copy the key into the build (eval.txt), which people then share."""
    secret = scene.root / "secret.txt"
    secret.write_text("private\n")
    for value in (str(secret), "../../secret.txt"):
        toml = _toml_with(scene, **{key: value}, **({"tokenizer": "tokenizer.json"} if key == "eval_text" else {}))
        with untouched(scene):
            cli("build", "--build-config", toml, says=(key, "outside the folder of this file", f"--{key.replace('_', '-')}"))
        assert not (scene.evil / "eval.txt").exists()


def test_a_path_in_a_toml_is_relative_to_the_toml(scene):
    from andrea_export.pipeline import BuildOptions

    toml = _toml_with(scene, out="o1", timing_cache="cache/t.cache")
    opts = BuildOptions.from_toml(toml)
    assert opts.out == str((scene.evil / "o1").resolve()) and opts.timing_cache == str((scene.evil / "cache/t.cache").resolve())
    elsewhere = scene.root / "elsewhere.json"  # given on the command line, a path may be anywhere
    assert BuildOptions.from_toml(_toml_with(scene, config=str(elsewhere)), config=str(elsewhere)).config == str(elsewhere)


def test_a_build_config_toml_repeats_its_build_from_its_own_folder(tiny_build, tmp_path):
    """The folder's own build-config.toml names the folder and its copies, relative to itself: it still
    repeats the build after the folder moved."""
    from andrea_export.pipeline import BuildOptions

    out, _ = tiny_build
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    text = (moved / "build-config.toml").read_text()
    assert 'out = "."' in text and str(out) not in text
    assert BuildOptions.from_toml(moved / "build-config.toml").out == str(moved.resolve())


# ---- a build folder's tokenizer: an artifact like every other ----------------------------------------------


@pytest.fixture
def tokenized(scene, demo_dir):
    """The evil build with the demo's tokenizer.json recorded in its manifest (as `build --tokenizer` does)."""
    from andrea_export.folder.atomic import sha256_file

    tok = scene.evil / "tokenizer.json"
    shutil.copy(demo_dir / "tokenizer.json", tok)
    m = scene.manifest()
    m["artifacts"]["tokenizer"] = {"path": "tokenizer.json", "sha256": sha256_file(tok), "bytes": tok.stat().st_size}
    scene.write_manifest(m)
    cli("generate", scene.evil, "--prompt", "Return a new", "-n", "2", code=0)  # the intact folder works
    return tok


def test_a_tampered_tokenizer_is_refused(scene, tokenized):
    data = json.loads(tokenized.read_text())
    data["normalizer"] = {"type": "Replace", "pattern": {"String": "new"}, "content": "old"}  # "new" reads "old"
    tokenized.write_text(json.dumps(data))
    with untouched(scene):
        cli("generate", scene.evil, "--prompt", "Return a new", "-n", "2", says=("tokenizer.json", "changed"))


def test_a_tokenizer_the_manifest_does_not_record_is_refused(scene, tokenized):
    m = scene.manifest()
    del m["artifacts"]["tokenizer"]
    scene.write_manifest(m)
    with untouched(scene):
        cli("generate", scene.evil, "--prompt", "Return a new", "-n", "2", says=("tokenizer.json", "not recorded"))


def test_a_tokenizer_linking_out_of_the_folder_is_refused(scene, tokenized):
    outside = scene.root / "tok.json"
    shutil.copy(tokenized, outside)
    tokenized.unlink()
    tokenized.symlink_to(outside)  # same bytes, so the sha256 matches: only the link tells
    with untouched(scene):
        cli("generate", scene.evil, "--prompt", "Return a new", "-n", "2", says=("tokenizer.json", "outside"))


# ---- model configs and checkpoints: bounded before anything is allocated ------------------------------------


@pytest.mark.parametrize("field, value", [("n_layer", 1_000_000), ("n_positions", 10**9), ("vocab_size", 10**8),
                                          ("n_embd", 1 << 20), ("n_head", 4096)])
def test_every_config_field_has_an_upper_bound(scene, field, value):
    cfg = {**ANDREA_TINY.to_dict(), field: value} | ({"n_embd": 4096 * 4} if field == "n_head" else {})
    path = scene.root / "huge.json"
    path.write_text(json.dumps(cfg))
    with untouched(scene):
        cli("export", "--config", path, "--out", scene.root / "m.onnx", says=(field, "at most"))


def test_a_config_too_large_in_total_is_refused(scene):
    cfg = {**ANDREA_TINY.to_dict(), "n_embd": 8192, "n_head": 64, "n_layer": 128}  # each field allowed: 100 G params
    path = scene.root / "big.json"
    path.write_text(json.dumps(cfg))
    cli("export", "--config", path, "--out", scene.root / "m.onnx", says=("parameters", "at most"))


_LOAD_AND_MEASURE = """
import resource, sys
from andrea_export.errors import CheckpointError
from andrea_export.model.checkpoint import load_checkpoint
try:
    load_checkpoint(sys.argv[1])
    print("loaded")
except CheckpointError as e:
    print("refused:", e)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)  # MiB
"""


def test_a_checkpoint_bomb_costs_no_more_memory_than_a_good_checkpoint(scene):
    """Tiny tensors whose metadata claims a 1.6 G-parameter model (every field within its bound): refused by
    the shapes before the model is built, at the memory a good tiny checkpoint costs."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    from andrea_export.model.checkpoint import random_init

    state = {k: v.contiguous() for k, v in random_init(ANDREA_TINY, announce=False).state_dict().items()}
    good, bomb = scene.root / "good.safetensors", scene.root / "bomb.safetensors"
    save_file(state, str(good), metadata={"andrea.config": json.dumps(ANDREA_TINY.to_dict())})
    claim = {**ANDREA_TINY.to_dict(), "n_embd": 2048, "n_head": 16, "n_layer": 32, "n_positions": 2048}
    save_file(state, str(bomb), metadata={"andrea.config": json.dumps(claim)})
    runs = {}
    for name, path in (("good", good), ("bomb", bomb)):
        run = subprocess.run([sys.executable, "-c", _LOAD_AND_MEASURE, str(path)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        runs[name] = run.stdout.splitlines()
    assert runs["good"][0] == "loaded"
    assert runs["bomb"][0].startswith("refused:") and "does not fit" in runs["bomb"][0], runs["bomb"]
    assert int(runs["bomb"][1]) <= int(runs["good"][1]) + 64, runs  # MiB: the claimed model is 6.4 GB


@pytest.mark.parametrize("change, says", [
    (lambda s: {**s, "wte.weight": s["wte.weight"][:, 0].contiguous()}, "wte.weight"),  # 1-D, no metadata
    (lambda s: {**s, "h.0.mlp.c_fc.weight": s["h.0.mlp.c_fc.weight"].to(__import__("torch").float8_e4m3fn)},
     "float8_e4m3fn"),
])
def test_odd_tensors_in_a_checkpoint_are_one_clear_error(scene, change, says):
    from safetensors.torch import save_file

    from andrea_export.model.checkpoint import random_init

    state = {k: v.contiguous() for k, v in random_init(ANDREA_TINY, announce=False).state_dict().items()}
    path = scene.root / "odd.safetensors"
    save_file(change(state), str(path))
    with untouched(scene):
        cli("export", "--checkpoint", path, "--out", scene.root / "m.onnx", says=says)


def _rehash(scene: Scene, name: str) -> None:
    """Record `name`'s new bytes in the manifest, as a hostile folder's author would."""
    from andrea_export.folder.atomic import sha256_file

    m = scene.manifest()
    for a in m["artifacts"].values():
        if a["path"] == name:
            a["sha256"], a["bytes"] = sha256_file(scene.evil / name), (scene.evil / name).stat().st_size
    scene.write_manifest(m)


@pytest.mark.parametrize("offset", ["abc", "-5", "1e3", ""])
def test_an_external_data_offset_that_is_no_byte_offset_is_one_clear_error(scene, offset):
    import onnx

    graph = scene.evil / "decoder.inplace.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    t = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    entry = next((e for e in t.external_data if e.key == "offset"), None) or t.external_data.add(key="offset")
    entry.value = offset
    onnx.save(model, str(graph))
    _rehash(scene, "decoder.inplace.onnx")
    with untouched(scene):
        cli("generate", scene.evil, "--prompt-ids", "1,2", "-n", "1", says=("decoder.inplace.onnx", t.name))


def test_verify_refuses_a_graph_pointing_into_an_unrecorded_weights_file(scene):
    """package and generate refused it already; verify read the other file's weights and said 'passed'."""
    import onnx

    shutil.copy(scene.evil / "weights.fp32.data", scene.evil / "weights.other.data")
    graph = scene.evil / "model.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "weights.other.data"
    onnx.save(model, str(graph))
    _rehash(scene, "model.onnx")
    with untouched(scene):
        cli("verify", scene.evil, "--greedy-steps", "0", "--shapes", "1x2", says=("weights.other.data", "does not record"))


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_inspect_does_not_call_a_linked_weights_file_intact(scene, link):
    weights = scene.evil / "weights.fp32.data"
    if link == "symlink":
        outside = scene.root / "w.data"
        shutil.move(weights, outside)
        weights.symlink_to(outside)  # same bytes: the sha256 matches, every other command refuses it
    else:
        os.link(weights, scene.root / "another-name.data")
    out = cli("inspect", scene.evil, says="weights.fp32.data")
    assert "every artifact matches" not in out


@pytest.mark.parametrize("command", ["inspect", "verify", "generate", "package"])
def test_a_manifest_nested_too_deep_is_one_clear_error_in_every_command(scene, command, tmp_path):
    (scene.evil / "manifest.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    args = {"inspect": [], "verify": ["--greedy-steps", "0"], "generate": ["--prompt-ids", "1", "-n", "1"],
            "package": ["--triton", str(tmp_path / "repo")]}[command]
    if command == "package" and not TRITON:
        pytest.skip("the 'triton' extra (tritonclient) writes Triton configs")
    with untouched(scene):
        cli(command, scene.evil, *args, says=("manifest.json", "deeper than 64"))
