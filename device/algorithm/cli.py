"""``aisynergy algorithm``: write a template, build a package, run one locally (no hub).

Exit codes: 0 done; 2 bad input (a package, configuration, dataset or client that does not keep the contract,
with the reason on stderr); 1 the algorithm itself raised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from device.algorithm.client import (
    AlgorithmError,
    checked_evaluate,
    checked_fit,
    checked_initial_parameters,
    save_parameters,
)
from device.algorithm.loader import load_client, read_manifest
from device.algorithm.package import build
from device.algorithm.template import write_template


class BadInput(click.ClickException):
    exit_code = 2


@click.group()
def algorithm() -> None:
    """Users' training code as packages: template, build, local run."""


@algorithm.command("new")
@click.argument("name")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True)
def new_cmd(name: str, directory: Path) -> None:
    """Write a working template (manifest and a numpy client) into DIR/NAME."""
    try:
        root = write_template(name, directory)
    except AlgorithmError as exc:
        raise BadInput(str(exc)) from None
    click.echo(str(root))


@algorithm.command("build")
@click.argument("source", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None, help="default: SOURCE/dist")
def build_cmd(source: Path, out: Path | None) -> None:
    """Zip SOURCE into NAME-VERSION.zip with its manifest at the root."""
    try:
        click.echo(str(build(source, out or source / "dist")))
    except AlgorithmError as exc:
        raise BadInput(str(exc)) from None


def _datasets(values: tuple[str, ...]) -> dict[str, Path]:
    datasets = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise BadInput(f"--dataset {value!r}: it is NAME=PATH")
        if name in datasets:
            raise BadInput(f"--dataset {name} given twice")
        datasets[name] = Path(path)
    return datasets


def _config(value: str | None) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        config = json.loads(Path(value[1:]).read_text() if value.startswith("@") else value)
    except (OSError, ValueError) as exc:
        raise BadInput(f"--config is not JSON (or @FILE of JSON): {exc}") from None
    if not isinstance(config, dict):
        raise BadInput("--config is a JSON object")
    return config


@algorithm.command("run")
@click.argument("source", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--dataset", "datasets", multiple=True, metavar="NAME=PATH", help="a dataset the client reads (a file or a folder)")
@click.option("--config", "config", default=None, metavar="JSON|@FILE", help="the algorithm's configuration")
@click.option("--rounds", type=click.IntRange(0, 100000), default=1, show_default=True,
              help="0: fit nothing (with --save: the algorithm's initial parameters, what a whole-model task starts from)")
@click.option("--save", "save", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write the trained parameters here (safetensors)")
def run_cmd(source: Path, datasets: tuple[str, ...], config: str | None, rounds: int, save: Path | None) -> None:
    """Fit then evaluate ROUNDS times in this process; each result is a JSON line on stdout."""
    try:
        _, client = load_client(source, _config(config), _datasets(datasets))
        parameters = checked_initial_parameters(client)
        for round_ in range(1, rounds + 1):
            fitted = checked_fit(client, parameters, {"round": round_})
            parameters = fitted.parameters
            click.echo(json.dumps({"round": round_, "phase": "fit", "num_examples": fitted.num_examples, "metrics": fitted.metrics}))
            evaluated = checked_evaluate(client, parameters, {"round": round_})
            click.echo(json.dumps({"round": round_, "phase": "evaluate", "loss": evaluated.loss,
                                   "num_examples": evaluated.num_examples, "metrics": evaluated.metrics}))
    except AlgorithmError as exc:
        raise BadInput(str(exc)) from None
    if save is not None:
        save_parameters(parameters, save)


def _package(source: Path) -> tuple[Path, str, str]:
    """The zip to upload for SOURCE (a package folder, built into SOURCE/dist first, or a built zip) and its name and
    version, from its own manifest."""
    import tempfile
    import zipfile

    from interfaces.algorithms import MANIFEST_NAME

    if source.is_dir():
        manifest = read_manifest(source)
        return build(source, source / "dist"), manifest.name, manifest.version
    try:
        with zipfile.ZipFile(source) as archive, tempfile.TemporaryDirectory() as scratch:
            (Path(scratch) / MANIFEST_NAME).write_bytes(archive.read(MANIFEST_NAME))
            manifest = read_manifest(Path(scratch))
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise AlgorithmError(f"{source} is not a built algorithm package (a zip with {MANIFEST_NAME} at its root): {exc}") from None
    return source, manifest.name, manifest.version


@algorithm.command("upload")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--hub", "hub_url", envvar="AISYNERGY_HUB_URL", default="https://127.0.0.1:8000", show_default=True, help="the hub's base URL")
@click.option("--token", envvar="AISYNERGY_TOKEN", required=True, help="an operator token (aisynergy hub token create --role operator)")
@click.option("--ca-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), envvar="AISYNERGY_CA_FILE", default=None,
              help="the CA bundle the hub's certificate is checked against (default: the system's)")
def upload_cmd(source: Path, hub_url: str, token: str, ca_file: Path | None) -> None:
    """Build SOURCE (a package folder) or take SOURCE (a built zip), and store it on the hub as the algorithm artefact
    NAME VERSION of its manifest; prints the stored artefact as JSON. The hub signs it; training tasks name it."""
    import httpx

    from interfaces import API_PREFIX

    try:
        package, name, version = _package(source)
    except AlgorithmError as exc:
        raise BadInput(str(exc)) from None
    verify: Any = str(ca_file) if ca_file is not None else True
    fields = {"kind": "algorithm", "name": name, "version": version, "format": "zip"}
    try:
        with httpx.Client(base_url=hub_url.rstrip("/"), verify=verify, timeout=httpx.Timeout(120.0, connect=10.0)) as client, package.open("rb") as stream:
            response = client.post(API_PREFIX + "/artifacts", data=fields, files={"file": (package.name, stream, "application/zip")},
                                   headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach the hub at {hub_url}: {exc}") from exc
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text[:300])
        except ValueError:
            detail = response.text[:300]
        raise (BadInput if 400 <= response.status_code < 500 else click.ClickException)(f"{response.status_code}: {detail}")
    click.echo(json.dumps(response.json()))
