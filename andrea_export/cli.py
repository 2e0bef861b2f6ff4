"""The `andrea-export` command line: a thin layer over the pipeline modules. Each command parses its
options, calls one Python function, and turns AndreaExportError into one clear line and exit code 1."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from . import __version__
from .errors import AndreaExportError


def _user_errors(fn):
    """Bad input is a message, not a traceback. Anything else is a bug and keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except AndreaExportError as e:
            from .progress import console

            console.print(f"[bold red]error:[/] {e}", markup=True, highlight=False, soft_wrap=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing half-written was left behind", err=True)
            sys.exit(130)

    return wrapper


def _shapes(ctx, param, value: str | None):
    if not value:
        return None
    try:
        return [tuple(int(v) for v in s.lower().split("x")) for s in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"'{value}': expected BATCHxSEQ[,BATCHxSEQ...], e.g. 1x1,2x1024") from None


checkpoint_option = click.option(
    "--checkpoint", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Weights: .safetensors (project or GPT-2 layout) or .pt/.bin (read with weights_only). "
         "Default: seeded random weights, announced.")
config_option = click.option(
    "--config", "config", default=None, metavar="NAME|FILE",
    help="Model config: a preset (andrea-120m, andrea-tiny) or a JSON file like models/andrea-120m.json. "
         "Default: read from the checkpoint, else andrea-120m.")
seed_option = click.option("--seed", default=0, show_default=True, help="Seed of the random weights (no checkpoint).")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="andrea-export")
def main():
    """ANDREA-120M from PyTorch to verified ONNX and TensorRT engines.

    \b
    Typical use:
      andrea-export export --out build/model.onnx          # PyTorch -> ONNX (opset 20)
      andrea-export verify build/model.onnx                 # Polygraphy: ONNX Runtime vs PyTorch
    """


@main.command()
@checkpoint_option
@config_option
@seed_option
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("model.onnx"),
              show_default=True, help="The ONNX file to write (written atomically).")
@click.option("--opset", default=20, show_default=True, help="ONNX opset (>= 20: tanh-GELU as one Gelu node).")
@_user_errors
def export(checkpoint, config, seed, out, opset):
    """Export the model to ONNX: input_ids int64 [batch, seq] -> logits float32 [batch, seq, vocab].

    Batch and sequence are dynamic (sequence up to the model's context). The export is deterministic:
    the same weights give byte-identical files. The model config and the weights' origin are stored in
    the ONNX metadata, so `verify` needs only the file (and the checkpoint, if there was one).
    """
    from .checkpoint import load_model
    from .config import load_config
    from .export import check_onnx, export_onnx, op_counts

    model = load_model(checkpoint, load_config(config) if config else None, seed=seed)
    export_onnx(model, out, opset=opset)
    counts = op_counts(check_onnx(out))
    click.echo(f"{out}: {sum(counts.values())} nodes, {counts['Gelu(tanh)']} tanh-GELU, "
               f"{model.n_params():,} parameters")


@main.command()
@click.argument("onnx_file", type=click.Path(dir_okay=False, path_type=Path))
@checkpoint_option
@config_option
@click.option("--shapes", default=None, metavar="BxT,...",
              callback=_shapes,
              help="Input shapes to compare, e.g. 1x1,4x64,2x1024. Default: 1x1, 1x17, 4x64, 2x<context>.")
@click.option("--greedy-steps", default=32, show_default=True, help="Greedy tokens decoded by both (0: skip).")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON report here. Default: <onnx_file>.verify.json")
@_user_errors
def verify(onnx_file, checkpoint, config, shapes, greedy_steps, report):
    """Verify an ONNX file against the PyTorch model with Polygraphy (ONNX Runtime on this machine).

    Compares logits with explicit tolerances (max/mean/median absolute and relative error), top-1 and
    top-5 agreement of next-token predictions, the KL divergence of the next-token distributions, and
    greedy decoding. Exits 1 if any check fails.
    """
    from .config import load_config
    from .verify import print_summary, reference_model_for
    from .verify import verify as run_verify

    model = reference_model_for(onnx_file, checkpoint, load_config(config) if config else None)
    result = run_verify(model, {"onnxrt": onnx_file}, shapes=shapes, greedy_steps=greedy_steps)
    path = result.save(report or onnx_file.with_name(onnx_file.name + ".verify.json"))
    print_summary(result)
    click.echo(f"report: {path}")
    sys.exit(0 if result.passed else 1)
