"""``aisynergy contracts``: regenerate or check the committed contract artefacts."""

from __future__ import annotations

import click


@click.group()
def contracts() -> None:
    """OpenAPI, JSON Schemas and the topic table under interfaces/."""


@contracts.command("write")
def write_cmd() -> None:
    """Regenerate the artefacts from the code."""
    from cloud.contracts import write

    for path in write():
        click.echo(f"wrote {path}")


@contracts.command("check")
def check_cmd() -> None:
    """Exit 1 if any artefact differs from what the code generates."""
    from cloud.contracts import drift

    stale = drift()
    for path in stale:
        click.echo(f"out of date: {path}", err=True)
    if stale:
        raise SystemExit(1)
    click.echo("contracts are up to date")
