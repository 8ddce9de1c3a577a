"""``aisynergy model``: split an ONNX model into a device head and an edge tail (DESIGN §5, cloud/ml/partition.py).

    aisynergy model cuts digits-cnn.onnx                     # the clean cut points, in order, with their shapes
    aisynergy model split digits-cnn.onnx max_pool2d         # digits-cnn.head.onnx + digits-cnn.tail.onnx
    aisynergy model profile digits-cnn.onnx --runs 50 --batch 8 [--cut relu_1 ...] [--json]

``profile`` runs ONNX Runtime on this machine: run it on the device (head) and on the edge (tail) to measure
each side. Needs the ``[hub]`` extra (onnx; ONNX Runtime for ``profile``).
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import onnx

from cloud.ml import partition


def _load(path: Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf's decode errors and onnx's alike
        raise click.ClickException(f"{path}: not an ONNX model ({type(exc).__name__}: {exc})") from None


def _shape(shape: list[int | str | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


@click.group()
def model() -> None:
    """Partition ONNX models for split inference: list cut points, split, profile."""


@model.command("cuts")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print a JSON list")
def cuts_cmd(path: Path, as_json: bool) -> None:
    """The tensors at which PATH splits cleanly (only that tensor crosses), in topological order."""
    loaded = _load(path)
    types = partition.tensor_types(loaded)
    found = [{"tensor": t, "shape": types.get(t, ([], ""))[0], "dtype": types.get(t, ([], ""))[1]} for t in partition.candidate_cuts(loaded)]
    if as_json:
        click.echo(json.dumps(found))
        return
    width = max([len(c["tensor"]) for c in found] + [6])
    shapes = [_shape(c["shape"]) for c in found]
    shape_width = max([len(s) for s in shapes] + [5])
    click.echo(f"{'tensor':<{width}}  {'shape':<{shape_width}}  dtype")
    for c, shape in zip(found, shapes, strict=True):
        click.echo(f"{c['tensor']:<{width}}  {shape:<{shape_width}}  {c['dtype']}")


@model.command("split")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("tensor")
@click.option("--head", "head_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="default: <model>.head.onnx beside the model")
@click.option("--tail", "tail_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="default: <model>.tail.onnx beside the model")
def split_cmd(path: Path, tensor: str, head_path: Path | None, tail_path: Path | None) -> None:
    """Cut PATH at TENSOR into a head (inputs -> TENSOR) and a tail (TENSOR -> outputs), both checked."""
    try:
        head, tail = partition.split_model(_load(path), tensor)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    head_path = head_path or path.with_name(f"{path.stem}.head.onnx")
    tail_path = tail_path or path.with_name(f"{path.stem}.tail.onnx")
    for target, part in ((head_path, head), (tail_path, tail)):
        target.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(part, str(target))
        click.echo(f"wrote {target} ({target.stat().st_size} bytes, {len(part.graph.node)} nodes)")


@model.command("profile")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--cut", "cuts", multiple=True, help="a tensor to profile (repeatable; default: every candidate cut)")
@click.option("--runs", default=20, show_default=True, type=click.IntRange(min=1), help="timed runs of each part (median)")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1), help="rows per run (the dynamic batch dimension)")
@click.option("--threads", default=None, type=click.IntRange(min=1), help="ONNX Runtime intra-op threads (default: its own)")
@click.option("--json", "as_json", is_flag=True, help="print a JSON list")
def profile_cmd(path: Path, cuts: tuple[str, ...], runs: int, batch: int, threads: int | None, as_json: bool) -> None:
    """Median head and tail latency (ONNX Runtime, this machine) and activation size of every cut of PATH, after
    the whole model's."""
    try:
        rows = partition.profile(_load(path), list(cuts) or None, runs=runs, batch=batch, threads=threads)
    except ImportError as exc:
        raise click.ClickException(f"profiling needs ONNX Runtime ({exc.name}): pip install 'aisynergy[hub]'") from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows]))
        return
    width = max([len(r.tensor or "") for r in rows] + [len("(whole model)")])
    click.echo(f"{'cut':<{width}}  {'head ms':>9}  {'tail ms':>9}  {'bytes':>9}  shape")
    for r in rows:
        click.echo(f"{r.tensor or '(whole model)':<{width}}  {r.head_ms:9.4f}  {r.tail_ms:9.4f}  {r.activation_bytes:9d}  {list(r.activation_shape)}")
