"""``aisynergy broker``: write the Mosquitto configuration and run it."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group()
def broker() -> None:
    """The MQTT 5 broker (Mosquitto) with mutual TLS and per-node ACLs."""


_opts = [
    click.option("--data-dir", type=click.Path(path_type=Path), envvar="AISYNERGY_DATA_DIR", default=".data", show_default=True),
    click.option("--host", default="127.0.0.1", show_default=True, envvar="AISYNERGY_BROKER_HOST"),
    click.option("--port", default=8883, show_default=True, type=int, envvar="AISYNERGY_BROKER_PORT"),
    click.option("--hostname", "hostnames", multiple=True, help="extra names for the broker certificate"),
    click.option("--instance", default="broker", show_default=True,
                 help="name of this broker's folder under the data dir (brokers sharing one PKI need distinct names)"),
    click.option("--pki-dir", type=click.Path(path_type=Path), default=None, envvar="AISYNERGY_BROKER_PKI_DIR",
                 help="take the broker's TLS files and access lists from here (written by `broker share`, no CA key) "
                      "instead of DATA_DIR/pki"),
]


def _with_opts(fn):  # type: ignore[no-untyped-def]
    for opt in reversed(_opts):
        fn = opt(fn)
    return fn


@broker.command()
@_with_opts
def config(data_dir: Path, host: str, port: int, hostnames: tuple[str, ...], instance: str, pki_dir: Path | None) -> None:
    """Write the broker's TLS material, config and ACL, and print the config path."""
    from cloud.broker.config import BrokerLayout
    from cloud.broker.runner import BrokerError, prepare

    layout = BrokerLayout(data_dir.resolve(), instance, pki_dir.resolve() if pki_dir else None)
    try:
        prepare(layout, host, port, hostnames)
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(layout.config_file))


@broker.command()
@_with_opts
def run(data_dir: Path, host: str, port: int, hostnames: tuple[str, ...], instance: str, pki_dir: Path | None) -> None:
    """Install Mosquitto if missing, write its files and run it in the foreground."""
    from cloud.broker.config import BrokerLayout
    from cloud.broker.runner import BrokerError
    from cloud.broker.runner import run as run_broker

    try:
        code = run_broker(BrokerLayout(data_dir.resolve(), instance, pki_dir.resolve() if pki_dir else None), host, port, hostnames)
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from exc
    sys.exit(code)


@broker.command()
@_opts[0]
@click.option("--to", "dest", type=click.Path(path_type=Path), required=True, help="the directory the broker reads (its --pki-dir)")
@_opts[3]
def share(data_dir: Path, dest: Path, hostnames: tuple[str, ...]) -> None:
    """On the hub's side: keep a copy of only what the broker needs of DATA_DIR/pki (no CA or signing key)."""
    from cloud.broker.runner import share as share_files

    sys.exit(share_files(data_dir.resolve() / "pki", dest.resolve(), hostnames))
