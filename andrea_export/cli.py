"""The `andrea-export` command line: a thin layer over the pipeline modules. Each command parses its
options, calls one Python function, and turns AndreaExportError into one clear line and exit code 1."""

from __future__ import annotations

import errno
import functools
import re
import sys
from pathlib import Path

import click

from . import __version__
from .errors import AndreaExportError, ConfigError
from .deploy.gguf import GGUF_TYPES
from .names import MAX_SEED, MAX_SLOTS
from .pipeline import MAX_WORKSPACE_MB


def _user_errors(fn):
    """Bad input is a message, not a traceback. Anything else is a bug and keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except AndreaExportError as e:
            from .progress import error

            error(str(e))
            sys.exit(1)
        except OSError as e:
            if e.errno not in _USER_ERRNOS or e.filename is None:
                raise  # not about a path the user chose: a bug, keep the traceback
            from .progress import error

            error(f"{e.filename}: {e.strerror}")
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing half-written was left behind", err=True)
            sys.exit(130)

    return wrapper


def _stdout_is_terminal() -> bool:
    return sys.stdout.isatty()  # click.get_text_stream is deprecated (Click 8.5) and wraps this stream


# Where a user's path cannot be written or read as asked: said in one line, not a traceback.
_USER_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR,
                errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP, errno.ENOENT}  # ENOENT: a folder /proc cannot hold


def _shapes(ctx, param, value: str | None):
    """BATCHxN[,BATCHxN...] of ASCII integers; batch >= 1, and N >= 1 except a decode grid's past (>= 0).
    A generate grid is BATCHxPROMPTxNEW (each >= 1)."""
    if not value:
        return None
    if param.name == "generate_grid":
        shapes = []
        for s in value.split(","):
            m = re.fullmatch(r"\s*([0-9]+)[xX]([0-9]+)[xX]([0-9]+)\s*", s)
            if not m or min(int(g) for g in m.groups()) < 1:
                raise click.BadParameter(f"'{s}': expected BATCHxPROMPTxNEW[,...], each at least 1, e.g. 1x32x128")
            shapes.append(tuple(int(g) for g in m.groups()))
        return shapes
    second, low = ("past", 0) if param.name == "decode_grid" else ("seq", 1)
    shapes = []
    for s in value.split(","):
        m = re.fullmatch(r"\s*([0-9]+)[xX]([0-9]+)\s*", s)
        if not m:
            raise click.BadParameter(f"'{s}': expected BATCHx{second.upper()}[,BATCHx{second.upper()}...], e.g. 1x1,2x1024")
        b, t = int(m[1]), int(m[2])
        if b < 1 or t < low:
            raise click.BadParameter(f"'{s}': batch must be at least 1 and {second} at least {low}")
        shapes.append((b, t))
    return shapes


checkpoint_option = click.option(
    "--checkpoint", type=click.Path(path_type=Path), default=None,
    help="Weights: .safetensors (project or GPT-2 layout; a GPT-2 config.json beside it is read), a Hugging "
         "Face save_pretrained folder (sharded too), or .pt/.bin (read with weights_only). "
         "Default: seeded random weights, announced.")
config_option = click.option(
    "--config", "config", default=None, metavar="NAME|FILE",
    help="Model config: a preset (andrea-120m, andrea-tiny) or a JSON file like models/andrea-120m.json. "
         "Default: read from the checkpoint, else andrea-120m.")
seed_option = click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
                           help="Seed of the random weights (no checkpoint).")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="andrea-export")
@click.option("-v", "--verbose", is_flag=True, help="Also show the libraries' own log lines (ONNX Runtime's quantizer, "
              "onnxscript's optimizer, ...), which are hidden otherwise.")
def main(verbose):
    """ANDREA-120M from PyTorch to verified ONNX and TensorRT engines.

    \b
    Typical use:
      andrea-export build                                   # everything, into out/andrea-120m-fp32/
      andrea-export build --checkpoint w.safetensors --precision fp16 --out out/fp16
      andrea-export inspect out/fp16                        # what is in it, does it still match its sha256
      andrea-export verify out/fp16                         # again, here (on a GPU host: the engines too)
      andrea-export generate out/fp16 --prompt-ids 1,2,3    # KV-cache decoding (repeat for a batch)
      andrea-export train-demo --out demo                   # a small ANDREA trained on real text
      andrea-export package out/fp16 --triton models/       # a Triton model repository
      andrea-export bench --quick                           # latency vs PyTorch and the machine's limits
    \b
    Single stages: `export` (PyTorch -> ONNX), `verify FILE.onnx` (Polygraphy vs PyTorch).
    Without --checkpoint the weights are seeded random ones, announced on stderr.
    """
    _quiet_libraries(verbose)


def _quiet_libraries(verbose: bool) -> None:
    """Only our own progress and messages reach the terminal: the libraries' log records go to a root
    handler installed first, at ERROR (INFO with --verbose). A library's later logging.basicConfig(level=INFO)
    (ONNX Runtime's quantizer does it on import, and onnxscript and onnx_ir then log every pass) finds the
    root configured and changes nothing."""
    import logging

    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.ERROR)


@main.command()
@checkpoint_option
@config_option
@seed_option
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("model.onnx"),
              show_default=True, help="The ONNX file to write (written atomically).")
@click.option("--opset", default=20, show_default=True, help="ONNX opset (>= 20: tanh-GELU as one Gelu node).")
@click.option("--hf-folder", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Instead: write a folder Optimum's ORTModelForCausalLM loads (the KV-cache decoder as "
                   "model.onnx, a GPT-2 config.json and generation_config.json).")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="With --hf-folder: a tokenizer.json to put in the folder (with its tokenizer_config.json), so "
                   "that AutoTokenizer.from_pretrained(folder) loads it.")
@_user_errors
def export(checkpoint, config, seed, out, opset, hf_folder, tokenizer):
    """Export the model to ONNX: input_ids int64 [batch, seq] -> logits float32 [batch, seq, vocab].

    Batch and sequence are dynamic (sequence up to the model's context). The export is deterministic:
    the same weights give byte-identical files. The model config and the weights' origin are stored in
    the ONNX metadata, so `verify` needs only the file (and the checkpoint, if there was one).
    """
    from .config import load_config
    from .graphs.export import check_export_memory, export_onnx, op_counts
    from .graphs.layout import check_onnx
    from .model.checkpoint import load_model

    if tokenizer and not hf_folder:
        raise click.UsageError("--tokenizer goes with --hf-folder (an ONNX file carries no tokenizer)")
    cfg = load_config(config) if config else None
    if cfg is not None:
        check_export_memory(cfg)  # before the weights are allocated
    model = load_model(checkpoint, cfg, seed=seed)
    check_export_memory(model.cfg)  # a checkpoint's config is known once it is read
    if hf_folder:
        from .deploy.optimum import write_hf_folder

        click.echo(write_hf_folder(model, hf_folder, tokenizer=tokenizer))
        return
    export_onnx(model, out, opset=opset)
    counts = op_counts(check_onnx(out))
    click.echo(f"{out}: {sum(counts.values())} nodes, {counts['Gelu(tanh)']} tanh-GELU, "
               f"{model.n_params():,} parameters")


@main.command()
@click.argument("target", type=click.Path(path_type=Path))
@checkpoint_option
@config_option
@click.option("--shapes", default=None, metavar="BxT,...", callback=_shapes,
              help="Input shapes to compare, e.g. 1x1,4x64,2x1024. Default: 1x1, 1x17, 4x64, 2x<context>.")
@click.option("--greedy-steps", type=click.IntRange(min=0), default=32, show_default=True,
              help="Greedy tokens decoded by each (0: skip).")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="ONNX target: write the JSON report here. Default: <onnx_file>.verify.json")
@_user_errors
def verify(target, checkpoint, config, shapes, greedy_steps, report):
    """Verify an ONNX file or a build folder against the PyTorch model with Polygraphy.

    
    TARGET is an ONNX file (run with ONNX Runtime) or a build folder from `build`: then every artifact
    in it is verified again, the engine too where it can run (on a GPU host of the kind it was built
    for), and verify.json and the manifest's status are updated.

    \b
    What a build folder's verification re-reads:
      manifest.json         every artifact's sha256 first: a file changed since the build is refused
      the graphs            model.onnx, model.plugin.onnx, the decoders, and the weights files they
                            point into (only recorded ones); the engines where this machine runs them
      eval.txt, tokenizer   the build's own copies, for the perplexity (when it was built with them)
      the weights           a build from a checkpoint needs it again: --checkpoint (its sha256 must
                            match the manifest's); a random-weights build re-creates them from its seed

    Compares logits with explicit tolerances (max/mean/median absolute and relative error), top-1 and
    top-5 agreement of next-token predictions, the KL divergence of the next-token distributions, and
    greedy decoding. Exits 1 if any check fails.
    """
    if target.is_dir():
        from .pipeline import print_build_summary, verify_build
        from .verify.report import VerifyReport, print_summary

        from .catalog import Artifacts, Role

        manifest = verify_build(target, checkpoint, shapes, greedy_steps)
        print_summary(VerifyReport.load(Artifacts.of_manifest(target, manifest).path(Role.VERIFY_REPORT)))
        print_build_summary(manifest, target)
        sys.exit(1 if manifest["status"] == "failed" else 0)

    from .config import load_config
    from .verify.compare import verify as run_verify
    from .verify.reference import reference_model_for
    from .verify.report import print_summary

    model = reference_model_for(target, checkpoint, load_config(config) if config else None)
    result = run_verify(model, {"onnxrt": target}, shapes=shapes, greedy_steps=greedy_steps)
    path = result.save(report or target.with_name(target.name + ".verify.json"))
    print_summary(result)
    click.echo(f"report: {path}")
    sys.exit(0 if result.passed else 1)


@main.command()
@click.option("--build-config", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A TOML file with any of the options below (keys as in the build folder's build-config.toml). "
                   "Options given on the command line win. A TOML may come from anyone: its paths (checkpoint, "
                   "config, tokenizer, eval_text, timing_cache, out) are relative to its folder and must stay "
                   "inside it; a file elsewhere must be given on the command line.")
@checkpoint_option
@config_option
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
              help="Seed of the random weights (no checkpoint). [default: 0]")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]), default=None,
              help="Precision of the graph the engine is built from (TensorRT 11 and TensorRT-RTX are strongly "
                   "typed: LayerNorm and softmax stay float32). int8 / int4: weight-only (ONNX Runtime's "
                   "MatMulNBits; the engine gets the same weights as Q/DQ). [default: fp32]")
@click.option("--builder", type=click.Choice(["auto", "tensorrt", "tensorrt-rtx"]), default=None,
              help="auto: TensorRT when it is installed and a GPU is present (plugin engine), else TensorRT-RTX "
                   "(ahead of time on the CPU, native GELU). [default: auto]")
@click.option("--profile", "profiles", default=None, metavar="SPEC",
              help="Optimization profile(s) for input_ids, e.g. 'batch=1:4:16,seq=1:128:1024' (min:opt:max; "
                   "';' separates profiles). [default: batch=1:1:8, seq=1:128:<context>]")
@click.option("--opt-level", type=click.IntRange(0, 5), default=None, help="Builder optimization level. [default: 3]")
@click.option("--workspace-mb", type=click.IntRange(1, MAX_WORKSPACE_MB), default=None,
              help=f"Workspace memory limit in MiB, at most {MAX_WORKSPACE_MB:,} (1 TiB). [default: TensorRT's]")
@click.option("--compute-capability", "compute_capabilities", multiple=True,
              help="TensorRT-RTX target, repeatable: 7.5, 8.0, 8.6, 8.9, 12.0. [default: 8.0 8.6 8.9 12.0]")
@click.option("--timing-cache", type=click.Path(dir_okay=False), default=None,
              help="Timing cache file, loaded if present and saved after (TensorRT). [default: OUT/timing.cache]")
@click.option("--fuse-bias/--no-fuse-bias", default=None,
              help="Plugin graph: fold the MLP bias add into the plugin (TanhGeluBias). [default: no]")
@click.option("--decoder/--no-decoder", default=None,
              help="Also build the KV-cache decoder graph and its engine (prefill + decode profiles), which "
                   "`generate` and production runtimes use. [default: yes]")
@click.option("--max-slots", type=click.IntRange(0, MAX_SLOTS), default=None,
              help="Also build the in-flight batching engine (decoder.slots.plan, TensorRT >= 10.15) for up to this "
                   "many streams decoding at once; serve steps it on a GPU host (--engine). 0: none. [default: 0]")
@click.option("--strip-weights/--no-strip-weights", default=None,
              help="Weight-stripped engines for shipping beside the ONNX weights, refitted from them at load "
                   "(full TensorRT on a GPU host only; TensorRT-RTX's CPU builder rejects it). [default: no]")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A tokenizer.json (the 'text' extra) to carry into the folder: `generate --prompt` then uses it.")
@click.option("--eval-text", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A UTF-8 text (needs --tokenizer): verify.json then holds every artifact's perplexity on it "
                   "beside PyTorch's. Without it no perplexity is computed (random weights make it meaningless).")
@click.option("--out", default=None, help="Build folder. [default: out/<model>-<precision>]")
@click.option("--force", is_flag=True, help="Replace a folder that holds another build.")
@_user_errors
def build(build_config, checkpoint, config, seed, precision, builder, profiles, opt_level, workspace_mb,
          compute_capabilities, timing_cache, fuse_bias, decoder, max_slots, strip_weights, tokenizer, eval_text, out,
          force):
    """Checkpoint -> ONNX -> plugin graph -> TensorRT engine -> Polygraphy verification -> build folder.

    \b
    With no options: ANDREA-120M with seeded random weights (announced), fp32, built with TensorRT-RTX
    on a CPU machine or TensorRT on a GPU host, into out/andrea-120m-fp32/:
      model.onnx            standard graph (ONNX Runtime, TensorRT-RTX, TensorRT without the plugin)
      model.plugin.onnx     every tanh-GELU a call of our plugin andrea::TanhGelu (runs in ORT too)
      model.plan            the engine; model.plan.json says what built it, for which GPUs
      model.layers.json     the engine's layer report, where the builder can produce one
      decoder.onnx          the KV-cache decoder graph; decoder.plan its engine (profiles: prefill, decode)
      decoder.inplace.onnx  the decoder ONNX Runtime and onnxruntime-genai run: its cache written in place
      decoder.slots.onnx    the same in standard ops over a static cache (TensorRT's in-flight batching);
                            with --max-slots N, decoder.slots.plan: its engine (in-flight batching on a GPU)
      *.<int8|int4>.qdq.onnx int8/int4: the engines' graphs (Q/DQ), beside ONNX Runtime's MatMulNBits ones
      tokenizer.json        with --tokenizer; eval.txt with --eval-text (perplexity in verify.json)
      verify.json           Polygraphy's verdict per artifact and input shape, LM figures
      build-config.toml     the effective options: --build-config repeats the build
      manifest.json         everything above with sha256, versions, profiles, plugin kernel, status

    Exits 1 when verification fails (the manifest then says "failed").
    """
    from .pipeline import BuildOptions, print_build_summary, run_build

    overrides = dict(checkpoint=str(checkpoint) if checkpoint else None, config=config, seed=seed,
                     precision=precision, builder=builder, profiles=profiles, opt_level=opt_level,
                     workspace_mb=workspace_mb, compute_capabilities=list(compute_capabilities) or None,
                     timing_cache=timing_cache, fuse_bias=fuse_bias, decoder=decoder, max_slots=max_slots,
                     strip_weights=strip_weights,
                     tokenizer=tokenizer, eval_text=eval_text, out=out)
    if build_config:
        opts = BuildOptions.from_toml(build_config, **overrides)
    else:
        opts = BuildOptions(**{k: v for k, v in overrides.items() if v is not None})
    manifest = run_build(opts, force=force)
    out_dir = Path(manifest["options"]["out"])
    print_build_summary(manifest, out_dir)
    click.echo(str(out_dir / "manifest.json"))
    sys.exit(1 if manifest["status"] == "failed" else 0)


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a readable summary.")
@_user_errors
def inspect(path, as_json):
    """Summarise a build folder (manifest, status, sha256 check), an ONNX file (I/O, ops, plugin calls,
    metadata) or an engine (.plan: what built it, for which GPUs)."""
    import json as _json

    from .inspect import describe, print_description

    d = describe(path)
    if as_json:
        click.echo(_json.dumps(d, indent=2))
    else:
        print_description(d)
    if d.get("intact") is False:  # described, and said plainly: what is there is not what was built
        raise AndreaExportError(f"{path}: {d['integrity']}")


@main.command()
@click.argument("build_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--triton", "repo", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The Triton model repository to write into (created if missing; other models are left alone).")
@click.option("--gguf", "gguf_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also (or only) write a GGUF file of the build that llama.cpp loads as it is (llama-cli, "
                   "llama-server, Ollama, LM Studio): architecture gpt2, the build's tokenizer, its float32 weights "
                   "in --gguf-type. Needs the 'gguf' extra.")
@click.option("--gguf-type", type=click.Choice(list(GGUF_TYPES)), default=None,
              help="The GGUF's tensor type: float (f32 gives this build's tokens in llama.cpp), or one of ggml's block "
                   "formats, quantized from the float32 weights (vectors stay f32; at 4 and 5 bits the token "
                   "embedding, which is also the output, is q8_0; q4_0's linear layers are solved by GPTQ, as "
                   "an int4 build's are: about a minute for ANDREA-120M on 2 cores). [default: the build's "
                   "precision's: q4_0 for int4, q8_0 for int8, bf16 for bf16, else f16]")
@click.option("--name", default=None, help="Model name (= folder name). Default: <model>-<precision>-trt|onnx.")
@click.option("--backend", type=click.Choice(["auto", "tensorrt", "onnxruntime"]), default="auto", show_default=True,
              help="tensorrt: serve the engine; onnxruntime: serve the standard ONNX; auto: the engine when it is a "
                   "TensorRT (not TensorRT-RTX) plan and --kind gpu, else the ONNX.")
@click.option("--max-batch-size", type=click.IntRange(min=0), default=None,
              help="Triton's max_batch_size (0: no batching). Default: the engine profiles' largest batch.")
@click.option("--max-queue-delay-us", type=click.IntRange(min=0), default=0, show_default=True,
              help="How long the dynamic batcher may hold a request to grow a batch.")
@click.option("--dynamic-batching/--no-dynamic-batching", default=True, show_default=True)
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="Model instances (per GPU with --kind gpu).")
@click.option("--kind", type=click.Choice(["gpu", "cpu"]), default=None,
              help="Instance kind: KIND_GPU or KIND_CPU (ONNX Runtime only). [default: gpu on a machine with an "
                   "NVIDIA GPU, else cpu, said when chosen]")
@click.option("--overwrite", is_flag=True, help="Replace REPO/NAME if it exists.")
@click.option("--allow-failed", is_flag=True, help="Package a build whose verification failed.")
@click.option("--copy", "copy_files", is_flag=True, help="Copy the artifact instead of hard-linking it.")
@click.option("--generate/--no-generate", "generate", default=None,
              help="The generate model for Triton's Python backend (in-flight batching, token streaming; what "
                   "`andrea-export serve` runs): with --kind gpu on the build's in-flight batching engine when it "
                   "has one that TensorRT built (not with --backend onnxruntime), else on ONNX Runtime's CPU "
                   "provider. [default: when the build has what it would step]")
@click.option("--generate-only", is_flag=True, help="Only the generate model, not the ONNX / engine models.")
@click.option("--triton-release", default=None, metavar="YY.MM",
              help="The Triton release (nvcr.io/nvidia/tritonserver:YY.MM-py3) that will serve the models: recorded "
                   "in their configs; a TensorRT plan is refused when that release ships another TensorRT than the one "
                   "that built it (a release whose TensorRT is not known here is recorded as not checked).")
@_user_errors
def package(build_dir, repo, gguf_out, gguf_type, name, backend, max_batch_size, max_queue_delay_us, dynamic_batching,
            instances, kind, overwrite, allow_failed, copy_files, generate, generate_only, triton_release):
    """Package a build folder for Triton Inference Server (--triton REPO: REPO/NAME/config.pbtxt +
    REPO/NAME/1/model.plan|onnx) and/or llama.cpp (--gguf OUT.gguf).

    The config is written from Triton's own ModelConfig message (needs the 'triton' extra). The engine's
    tanh-GELU plugin is embedded in the plan: Triton needs no plugin library. A build with the KV-cache
    decoder also gets NAME-decoder-...: a stateful model whose cache Triton keeps (implicit state). Run
    the server with `tritonserver --model-repository=REPO`; see docs/deploying.md. For each TensorRT plan a line
    says the TensorRT version, the Triton releases that ship it and the GPU driver its plugin PTX needs.

    The GGUF file is for llama.cpp and what runs it: `llama-cli -m OUT.gguf`, `llama-server -m OUT.gguf`.
    """
    if repo is None and gguf_out is None:
        raise click.UsageError("give --triton REPO, --gguf OUT.gguf, or both")
    if gguf_out is not None:
        from .deploy.gguf import write_gguf
        from .progress import step

        with step(f"Writing {gguf_out} for llama.cpp ({gguf_type or 'the type of the build precision'})"):
            click.echo(write_gguf(build_dir, gguf_out, gguf_type, overwrite=overwrite, allow_failed=allow_failed))
    if repo is not None:
        _package_triton(build_dir, repo, name, backend, max_batch_size, max_queue_delay_us, dynamic_batching, instances,
                        kind, overwrite, allow_failed, copy_files, generate, generate_only, triton_release)


def _package_triton(build_dir, repo, name, backend, max_batch_size, max_queue_delay_us, dynamic_batching, instances,
                    kind, overwrite, allow_failed, copy_files, generate, generate_only, triton_release):
    from .deploy.triton import package as write_package
    from .deploy.triton import pin_summary
    from .errors import gpu_compute_capability
    from .progress import console

    if kind is None:
        kind = "gpu" if gpu_compute_capability() is not None else "cpu"
        if kind == "cpu":
            from .progress import warn

            warn("no GPU on this machine: packaging for CPU instances (KIND_CPU, ONNX Runtime); give --kind gpu "
                 "for a GPU server")
    for model_dir in write_package(build_dir, repo, name=name, backend=backend, max_batch_size=max_batch_size,
                                   dynamic_batching=dynamic_batching, max_queue_delay_us=max_queue_delay_us,
                                   instances=instances, kind=kind, overwrite=overwrite, allow_failed=allow_failed,
                                   hardlink=not copy_files, generate=generate, generate_only=generate_only,
                                   triton_release=triton_release):
        click.echo(model_dir)
        if note := pin_summary(model_dir):
            console.print(note, soft_wrap=True)  # stderr: stdout stays the model folders


@main.command()
@click.argument("build", type=click.Path(exists=True, path_type=Path))
@click.option("--prompt-ids", multiple=True,
              help="Prompt token ids, comma- or space-separated, e.g. '464,3290,318'. Repeat for several prompts.")
@click.option("--prompt", "prompt_text", multiple=True, help="Text prompt (needs --tokenizer). Repeatable.")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A tokenizer.json (Hugging Face `tokenizers`; the 'text' extra): encodes --prompt, decodes the "
                   "output. Default: the build folder's, if it was built with one.")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="New tokens per prompt (a prompt stops earlier at a --stop-id); prompt + new must fit the context.")
@click.option("--strategy", type=click.Choice(["greedy", "top-k", "top-p"]), default="greedy", show_default=True,
              help="greedy: the likeliest token each step (deterministic); top-k / top-p: sample (see --seed).")
@click.option("--temperature", type=float, default=1.0, show_default=True,
              help="Sampling only: logits are divided by it (below 1 sharper, above 1 flatter).")
@click.option("--top-k", type=int, default=50, show_default=True,
              help="top-k only: sample among the k likeliest tokens.")
@click.option("--top-p", type=float, default=0.9, show_default=True,
              help="top-p only: sample among the likeliest tokens whose probabilities add up to p (nucleus).")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
              help="Seed for top-k/top-p sampling (reproducible output); each prompt gets the tokens it gets alone.")
@click.option("--stop-id", "stop_ids", type=int, multiple=True, help="Stop at this token id (repeatable).")
@click.option("--ignore-eos", is_flag=True,
              help="Run on past the end-of-text token to --max-new-tokens. [default: stop there, where the "
                   "tokenizer names one]")
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt", "openvino"]), default="auto",
              show_default=True,
              help="auto: TensorRT when the folder has a decoder engine and TensorRT is installed; else OpenVINO in "
                   "bf16 where the build verified it and measured it faster than ONNX Runtime and this CPU has bf16 "
                   "(said on stderr); else ONNX Runtime. openvino (the 'openvino' extra): the build's fp32 decoder on "
                   "OpenVINO, in bf16 where the CPU has bf16 instructions (verified by the build: verify.json "
                   "'runtimes').")
@click.option("--inference-precision", type=click.Choice(["default", "bf16", "f32"]), default="default",
              show_default=True, help="--backend openvino only: what it computes in (default: bf16 where the CPU has it).")
@click.option("--kv-cache-precision", type=click.Choice(["default", "u8", "f16", "bf16", "f32"]), default="default",
              show_default=True,
              help="--backend openvino only: what its fused attention keeps the KV cache in (default: OpenVINO's, "
                   "u8 on x86 CPUs; f32 with --inference-precision f32).")
@click.pass_context
@_user_errors
def generate(ctx, build, prompt_ids, prompt_text, tokenizer, max_new_tokens, strategy, temperature, top_k, top_p, seed,
             stop_ids, ignore_eos, backend, inference_precision, kv_cache_precision):
    """Generate tokens with the KV-cache decoder of BUILD (a build folder, or a decoder .onnx file).

    Prints the new token ids of each prompt on a line of its own, in order, each followed by the prompt
    and its continuation as text when there is a tokenizer (--tokenizer, or the build folder's); each stops at
    the tokenizer's end-of-text token (the last id, not printed as text) unless --ignore-eos. Several
    prompts run as one batch. The cache stays on the device between steps; prompts that do not fit the
    context, empty prompts and ids outside the vocabulary are refused before anything runs.
    """
    from . import runtime
    from .model.text import load_tokenizer

    tokenizer = tokenizer or runtime.tokenizer_path(build)
    tok = load_tokenizer(tokenizer) if tokenizer else None
    if bool(prompt_ids) == bool(prompt_text):
        raise click.UsageError("give --prompt-ids or --prompt (either one, repeatable), not both")
    if prompt_text:
        if tok is None:
            raise click.UsageError("--prompt needs --tokenizer")
        for text in prompt_text:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
                raise ConfigError(f"--prompt {text.encode('utf-8', 'backslashreplace').decode()!r} is not UTF-8 text; "
                                  "give the prompt in UTF-8") from None
        prompts = [tok.encode(text).ids for text in prompt_text]
    else:
        prompts = []
        for text in prompt_ids:
            items = text.replace(",", " ").split()
            if not all(re.fullmatch(r"[0-9]+", x) for x in items):  # int() would take '١', '+1', '1_0'
                raise click.BadParameter(f"not a list of integers: {text!r} (token ids, ASCII digits)",
                                         param_hint="--prompt-ids")
            prompts.append([int(x) for x in items])
    # a sampling option the chosen strategy does not use is a mistake, not something to ignore quietly
    uses = {"greedy": set(), "top-k": {"temperature", "top_k", "seed"}, "top-p": {"temperature", "top_p", "seed"}}
    for name in ("temperature", "top_k", "top_p", "seed"):
        if name not in uses[strategy] and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError(f"--{name.replace('_', '-')} does not apply to --strategy {strategy}"
                                   + (" (greedy decoding samples nothing; choose --strategy top-k or top-p)"
                                      if strategy == "greedy" else ""))
    if backend == "auto":
        backend, why = runtime.default_backend(build)
        if why:
            from .progress import console

            console.print(why, markup=False, highlight=False)  # stderr: stdout stays the tokens
    with runtime.load(build, backend=backend, inference_precision=inference_precision,
                      kv_cache_precision=kv_cache_precision) as sess:
        if (sess.weights_source or {}).get("kind") == "random-init":  # as build and verify announce it
            from .progress import warn

            warn(f"{build} holds RANDOM weights (seed {sess.weights_source['seed']}), not a trained checkpoint: "
                 "the tokens it generates are meaningless")
        if sess.eos_id is None and tok is not None:  # a tokenizer given apart from the build names the end too
            sess.eos_id = tok.token_to_id(runtime.EOT)
        news = sess.generate_batch([runtime.Request(p, max_new_tokens, strategy, temperature, top_k, top_p, seed, stop_ids,
                                                    ignore_eos) for p in prompts])
    from .progress import for_terminal

    for prompt, new in zip(prompts, news):
        click.echo(" ".join(map(str, new)))
        if tok is not None:
            text = tok.decode(prompt + new)
            click.echo(for_terminal(text) if _stdout_is_terminal() else text)  # a pipe gets the text as it is


def _try_line(endpoints: dict[str, str], api_key: str | None) -> str | None:
    """A request to paste: to the OpenAI front, the endpoint for clients, when it runs; else Triton's generate,
    when its HTTP port listens."""
    import json

    if "openai" not in endpoints and "generate" not in endpoints:
        return None
    if "openai" not in endpoints:
        return f"curl -s {endpoints['generate']} -d '{json.dumps({'input_ids': [1, 2, 3], 'max_tokens': 16})}'"
    key = " -H 'Authorization: Bearer <key>'" if api_key else ""
    return f"curl -s {endpoints['openai']}/completions{key} -d '{json.dumps({'prompt': [1, 2, 3], 'max_tokens': 16})}'"


@main.command()
@click.argument("build_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the OpenAI-compatible front listens on: the one endpoint meant for clients. 0.0.0.0: "
                   "every interface (then set --api-key).")
@click.option("--triton-host", default="127.0.0.1", show_default=True,
              help="Address Triton's own HTTP, gRPC and metrics ports listen on. Wherever they do, its shared-memory, "
                   "model-control, trace and logging APIs answer only the admin key.")
@click.option("--port", "http_port", type=click.IntRange(0, 65535), default=None,
              help="Triton's own HTTP/REST port (KServe v2 and /generate), for clients of Triton's protocol; 0: a "
                   "free one. Off unless given (on at 8000 with --no-openai): a body Triton's HTTP layer cannot parse "
                   "crashes it, which the front refuses before Triton sees it, and any local process reaches a "
                   "loopback port. The front needs only Triton's gRPC.")
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Triton's Prometheus metrics (/metrics: its own, and the batcher's queue); 0: a free one. Off "
                   "unless given: it is Triton's HTTP layer too, which a 6 MB form body crashes. The front's "
                   "/metrics is always there.")
@click.option("--openai-port", type=click.IntRange(0, 65535), default=9000, show_default=True,
              help="The OpenAI-compatible front (/v1/models, /v1/completions).")
@click.option("--no-openai", is_flag=True, help="Do not start the OpenAI-compatible front.")
@click.option("--api-key", envvar="ANDREA_EXPORT_API_KEY", default=None,
              help="The key the front asks of every request but /health (Authorization: Bearer KEY). "
                   "[default: $ANDREA_EXPORT_API_KEY, else none: any client is served]")
@click.option("--chat-template", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="A chat template (Hugging Face's Jinja format) for /v1/chat/completions. [default: the build "
                   "tokenizer's, if it has one]")
@click.option("--served-model-name", default=None,
              help="The model id the front serves (/v1/models). [default: the Triton model's name]")
@click.option("--allowed-origins", multiple=True, metavar="ORIGIN",
              help="Let browser pages from ORIGIN call the front (CORS); repeat for several. [default: none]")
@click.option("--max-body-bytes", type=click.IntRange(1), default=1 << 20, show_default=True,
              help="Largest request body the front reads (413 beyond).")
@click.option("--max-connections", type=click.IntRange(1), default=512, show_default=True,
              help="Connections the front holds at once (503 beyond).")
@click.option("--max-requests", type=click.IntRange(1), default=256, show_default=True,
              help="Completions the front has in flight at once, decoding or waiting for a slot (503 beyond).")
@click.option("--read-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds a client has to send its whole request body (408 after).")
@click.option("--open-metrics", is_flag=True,
              help="The front's /metrics answers without the API key, for a Prometheus scraper that sends none (as "
                   "vLLM's does; it tells counts and latencies, never a prompt). [default: it asks the key, when one "
                   "is set: give Prometheus the key as its bearer token]")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="One line a request on stderr: client, method, path, status, seconds (never the prompt).")
@click.option("--max-batch", "slots", type=click.IntRange(1, 256), default=None,
              help="Requests that share a decode step (in-flight batching slots). [default: 16 on ONNX Runtime; on "
                   "TensorRT, what the slot engine was built for (build --max-slots)]")
@click.option("--engine", type=click.Choice(["auto", "onnxruntime", "tensorrt"]), default="auto", show_default=True,
              help="What the batcher steps: onnxruntime (the in-place decoder on the CPU) or tensorrt (the build's "
                   "in-flight batching engine, decoder.slots.plan, on GPU 0: needs `build --max-slots N`, and the "
                   "TensorRT that built it and cuda-python in the serving environment). auto: tensorrt when all of "
                   "that is there, else onnxruntime; the banner says which runs, and why.")
@click.option("--prefill-chunk", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="Most prompt tokens prefilled per step (one run: the oldest joining prompt's next chunk). "
                   "Smaller keeps the running streams' gaps shorter, larger gives first tokens sooner.")
@click.option("--step-tokens", type=click.IntRange(2), default=None,
              help="A budget of tokens per step while streams decode (as vLLM's max_num_batched_tokens): the "
                   "decoding rows first, the joining prompt's chunk the rest (at least 8). Evens out the "
                   "streams' gaps at the cost of first tokens; must exceed --max-batch. [default: none, "
                   "chunks of --prefill-chunk]")
@click.option("--env", "env", type=click.Path(path_type=Path), default=None,
              help="The serving environment (a venv with nvidia-pytriton, numpy < 2). [default: "
                   "$ANDREA_EXPORT_SERVE_ENV, else ./.venv-serve, made by `make serve-env`]")
@_user_errors
def serve(build_dir, host, triton_host, http_port, grpc_port, metrics_port, openai_port, no_openai, api_key,
          chat_template, served_model_name, allowed_origins, max_body_bytes, max_connections, max_requests,
          read_timeout, open_metrics, access_log, slots, engine, prefill_chunk, step_tokens, env):
    """Serve a build with a real Triton Inference Server: its generate model batches requests in flight and
    streams tokens, behind an OpenAI-compatible front (/v1/completions, /v1/chat/completions, /metrics, and
    /health: 200 while the model is READY in Triton). Ctrl-C or SIGTERM stops accepting, finishes the requests in
    flight, and exits 0.

    The front (--host, --openai-port) is what clients reach; Triton's own ports stay on 127.0.0.1 unless
    --triton-host says otherwise, and its HTTP port opens only with --port.

    Supervised: if tritonserver, its model's Python-backend stub or the front dies, /health fails at once, the
    streams in flight end with an error event, one line says what died, and serve exits 1 within seconds, for
    systemd or Kubernetes to restart it.

    On a GPU host, a build with the in-flight batching engine (build --max-slots N) is served from it: the
    batcher steps the slot cache on the GPU, decode steps replayed as CUDA graphs (--engine).

    \b
      andrea-export serve out/demo
      curl -s localhost:9000/v1/completions -d '{"prompt": "Create a new", "max_tokens": 16}'
      curl -s localhost:9000/health
    """
    import json
    import signal
    import threading

    from . import userfiles
    from .deploy.openai_front import Limits
    from .deploy.server import FrontOptions, start
    from .progress import console, step, warn

    if no_openai and http_port is None:
        http_port = 8000  # without the front, Triton's HTTP is the one route for HTTP clients
    front = None if no_openai else FrontOptions(
        host, openai_port, api_key, served_model_name,
        Limits(max_body_bytes=max_body_bytes, max_connections=max_connections, read_timeout_s=read_timeout,
               max_requests=max_requests),
        tuple(allowed_origins), access_log,
        userfiles.read_text(chat_template, 1 << 20, "a chat template", ConfigError) if chat_template else None,
        metrics_open=open_metrics)
    if not no_openai and not _loopback(host):
        warn(f"the OpenAI front listens on {host}, beyond this machine"
             + ("" if api_key else ": anyone who reaches it is served (no key; set --api-key)"))
    if not _loopback(triton_host):
        warn(f"Triton listens on {triton_host}, beyond this machine: anyone who reaches it is served (it asks no key "
             "of inference; keep --triton-host on 127.0.0.1)")
    if access_log:
        _log_front_requests()
    with step(f"Starting Triton Inference Server on {build_dir} (waiting for the model to be READY)"):
        server = start(build_dir, host=triton_host, http_port=http_port, grpc_port=grpc_port,
                       metrics_port=metrics_port, front=front, slots=slots, prefill_chunk=prefill_chunk,
                       step_tokens=step_tokens, env=env, engine=engine)
    if server.engine is not None:
        console.print(f"  {'engine':16s} {server.engine[1]}", markup=False, highlight=False)
    for kind, url in server.endpoints().items():
        console.print(f"  {kind:16s} {url}", markup=False, highlight=False)
    if tried := _try_line(server.endpoints(), api_key):
        console.print(f"  try: {tried}", markup=False, highlight=False)
    console.print("Serving; Ctrl-C stops (the requests in flight finish first).", markup=False)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    while not stopped.wait(0.2):
        if (died := server.wait(0)) is not None:  # what is left of it is gone already
            tail = _last_log_line(server.log_tail(200))
            server.stop()  # the front (its streams ended with an error event), the workspace
            raise AndreaExportError(f"{died}: serve stops" + (f" (the server's log ended: {tail})" if tail else ""))
    console.print("Stopping: finishing the requests in flight", markup=False)
    code = server.stop()
    if code != 0:  # e.g. idle keep-alive clients held it open past its exit timeout: the requests had ended
        warn(f"tritonserver exited with code {code}; its log ended:\n" + "\n".join(server.log_tail().splitlines()[-4:]))


def _last_log_line(log: str) -> str:
    """The last line of Triton's log that says something (not its start-up tables, nor a backtrace's frames)."""
    import re

    said = [line.strip() for line in log.splitlines()
            if line.strip() and not line.startswith(("+", "|")) and not re.match(r"\s*\d+# ", line)]
    return said[-1] if said else ""


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _log_front_requests() -> None:
    """The front's access log, one plain line a request on stderr."""
    import logging

    from .deploy.openai_front import ACCESS_LOG

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log = logging.getLogger(ACCESS_LOG)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


@main.command("train-demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("demo"), show_default=True,
              help="Folder for tokenizer.json, model.safetensors, heldout.txt, train.json and loss.png.")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
              help="Seed of the initial weights and the batches.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Optimizer steps. [default: the recipe's]")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch threads (fixed, so the result is bit-identical from run to run).")
@_user_errors
def train_demo(out, seed, steps, threads):
    """Train a small ANDREA on real text, on the CPU in about two minutes: a byte-level BPE tokenizer with
    ANDREA's 8449 tokens and the andrea-tiny model, both from the Python documentation this interpreter
    ships (pydoc_data.topics and the standard library's docstrings; every tenth block of the topics held
    out). Then, e.g.:

    \b
      andrea-export build --checkpoint demo/model.safetensors --tokenizer demo/tokenizer.json \\
          --eval-text demo/heldout.txt --precision fp16 --out out/demo-fp16
      andrea-export generate out/demo-fp16 --prompt "The for statement"
    """
    import dataclasses

    from .model.demo import Recipe
    from .model.demo import train_demo as run

    recipe = dataclasses.replace(Recipe(), seed=seed, threads=threads, **({"steps": steps} if steps else {}))
    log = run(out, recipe)
    click.echo(f"{out}: held-out perplexity {log['heldout_perplexity']:.2f} (unigram {log['unigram_perplexity']:.1f}, "
               f"untrained {log['initial_heldout_perplexity']:.0f}) on {log['heldout_tokens']:,} tokens; "
               f"{log['cpu_seconds']:.0f} s CPU, {log['wall_seconds']:.0f} s wall")


@main.command()
@checkpoint_option
@config_option
@seed_option
@click.option("--quick", is_flag=True, help="Small grids and few repeats: 1-2 minutes for ANDREA-120M on 2 cores.")
@click.option("--backends", default="torch,ort-cpu,ort-cpu-concat,ort-cpu-int8,ort-cpu-int4,ort-cuda,trt-native,trt-plugin,"
                                    "optimum,genai",
              show_default=True,
              help="Comma-separated. Backends this host cannot run are reported as skipped, with the reason. "
                   "optimum and genai are the peers (what users run instead), reported as time / ort-cpu's; "
                   "ort-cpu-concat is ours on the standard decoder (ort-cpu: the in-place one), for the gain; "
                   "ort-cpu-int8 / -int4 are ours on weight-only quantized graphs of the same weights. CPU peers "
                   "(the 'peers' extra): openvino (its default precision: bf16 on a bf16 CPU), openvino-f32, "
                   "openvino-int8, openvino-int4, ctranslate2, ctranslate2-int8, each held against ours at its "
                   "precision; ours-openvino is our graph and loop on OpenVINO (runtime.load(..., backend='openvino')).")
@click.option("--scenarios", default="prefill,decode,generate", show_default=True, help="Comma-separated.")
@click.option("--threads", type=int, default=None, help="Threads for every backend and the limit measurements "
              "(default: the CPUs this process may use).")
@click.option("--prefill-grid", default=None, callback=_shapes, metavar="BxT,...",
              help="Prefill shapes, e.g. 1x128,4x512 (default: 1/4/16 x 32/128/512/1024).")
@click.option("--decode-grid", default=None, callback=_shapes, metavar="BxP,...",
              help="Decode batch x past length, e.g. 1x127,8x512 (default: 1x127 and 1/8/32 x 128/512/1023).")
@click.option("--generate-grid", default=None, callback=_shapes, metavar="BxPROMPTxNEW,...",
              help="Generation shapes, e.g. 1x32x128,8x32x128 (default: 1/8 x 128 + 64 and 1/8 x 32 + 128).")
@click.option("--trt-engine", "trt_engines", multiple=True, metavar="VARIANT:ROLE=PLAN",
              help="A TensorRT engine (GPU hosts), e.g. native:prefill=build/model.plan, "
                   "plugin:decode=build/decoder.plan. Repeatable.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-out"), show_default=True,
              help="Folder for bench.json, bench.csv, bench.md and the PNG plots. Exported ONNX files are cached in "
                   "$ANDREA_EXPORT_CACHE/bench or ~/.cache/andrea-export/bench.")
@click.option("--spin/--no-spin", default=True, show_default=True,
              help="Let ONNX Runtime's threads spin-wait between ops in every ORT backend: ORT's own default, what "
                   "`runtime.load` gives you and what onnxruntime-genai always does. Spinning threads go on "
                   "spinning about 40 ms after a call, so such a run waits 50 ms (busily) before each call. "
                   "--no-spin: every ORT backend but genai sleeps between ops (for a machine shared with other work).")
@click.option("--compare", nargs=2, type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              metavar="A.json B.json", help="Only compare two earlier results: B/A ratios of the matching rows.")
@click.option("--serve", "serve_builds", multiple=True, metavar="LABEL=BUILD",
              help="Instead: the served model under load (the real Triton server of `serve`, streaming clients at "
                   "1/4/8/16, in-flight vs one-at-a-time vs whole-request batching). Repeat for several builds.")
@click.option("--serve-levels", default="1,4,8,16", show_default=True, help="Concurrent clients, comma-separated.")
@click.option("--serve-per-client", type=click.IntRange(1), default=3, show_default=True,
              help="Requests per client at each level.")
@click.option("--serve-soak", type=click.IntRange(0), default=0, show_default=True,
              help="Short requests after the levels (first build): errors and server memory growth.")
@click.option("--serve-load", type=click.Choice(["auto", "aiperf", "own"]), default="auto", show_default=True,
              help="The load generator: NVIDIA's aiperf (make bench-env), our own streaming client, or aiperf when "
                   "found. On a 2-core machine aiperf's processes take the cores the server needs: use own there.")
@click.option("--serve-step-tokens", type=click.IntRange(17), default=None,
              help="The servers' --step-tokens (their 16 slots decode first); default: none.")
@click.option("--serve-route-rounds", type=click.IntRange(0), default=3, show_default=True,
              help="What the OpenAI front costs, at the top level (our own client, in-flight): the same requests "
                   "through the front and straight to Triton, interleaved for this many rounds (0: not measured).")
@_user_errors
def bench(checkpoint, config, seed, quick, backends, scenarios, threads, prefill_grid, decode_grid, generate_grid,
          trt_engines, out, spin, compare, serve_builds, serve_levels, serve_per_client, serve_soak, serve_load,
          serve_step_tokens, serve_route_rounds):
    """Latency of PyTorch eager, ONNX Runtime and TensorRT on the same weights and inputs, each figure beside
    the machine's own limits (memory bandwidth, matmul rate) measured in the same run.

    \b
    Scenarios: prefill (batch x seq), one decode step with the KV cache (batch x past), greedy generation.
    Backends are interleaved; speedups are medians of per-iteration ratios. See benchmarks/README.md.
    """
    from . import bench as bench_mod
    from .bench import report as bench_report

    if serve_builds:
        from .bench.load import run_serve_benchmark

        builds = dict(spec.split("=", 1) if "=" in spec else (Path(spec).name, spec) for spec in serve_builds)
        try:
            levels = [int(x) for x in serve_levels.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"{serve_levels!r}: comma-separated client counts, e.g. 1,4,8,16",
                                     param_hint="--serve-levels") from None
        if not levels or min(levels) < 1:
            raise click.BadParameter("at least one client count, each >= 1", param_hint="--serve-levels")
        run_serve_benchmark(builds, levels=levels, per_client=serve_per_client, soak=serve_soak, load=serve_load,
                            step_tokens=serve_step_tokens, route_rounds=serve_route_rounds, out=out)
        click.echo(f"report: {out / 'serve.md'}; serve.json and serve.png beside it")
        return
    if compare:
        rows = bench_report.compare(*compare)
        click.echo(bench_report.compare_markdown(rows, compare[0].parent.name or "A", compare[1].parent.name or "B"))
        return
    bench_mod.run_benchmark(
        config, checkpoint, seed=seed, quick=quick, threads=threads, out=out,
        backends=bench_mod.parse_names(backends, bench_mod.BACKENDS, "backend"),
        scenarios=bench_mod.parse_names(scenarios, bench_mod.SCENARIOS, "scenario"),
        prefill_grid=prefill_grid, decode_grid=decode_grid, generate_grid=generate_grid,
        trt_engines=bench_mod.parse_engine_specs(trt_engines), ort_spin=spin,
    )
    # the goals were printed, the files written: the whole report (a table per scenario) is in bench.md
    click.echo(f"report: {out / 'bench.md'} (tables of every case, peers, goals); plots and bench.json beside it")
