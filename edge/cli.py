"""``aisynergy edge``: run the edge agent.

``aisynergy edge run --hub URL --node-id ID [--bootstrap-token-file F --ca-sha256 H] --data-dir DIR`` enrols
once (CSR + bootstrap token -> certificate, kept in DIR; the hub CA is fetched and checked against its
fingerprint ``H`` before the token is sent: :mod:`device.enrol`) and then keeps the node's MQTT session up
until SIGTERM or SIGINT. A restart with a stored certificate needs neither the token nor the hub. The
certificate is renewed at the hub from the stored identity, at start and every 12 hours, once less than 60 days
of it are left (:mod:`device.renewal`); one expired beyond the renewal grace window (30 days) cannot be: the
agent exits 4, and the node re-enrols with a new bootstrap token (remove DIR/enrolment.json).

Devices connect to ``--downstream-mqtt-url`` (default: the hub's broker, over the same connection) and
enrol through the proxy on ``--device-listen`` (default 127.0.0.1:8090; ``off`` disables), which tells
them to connect to ``--device-mqtt-url`` (default: the downstream URL). The same listener serves them
artefacts from the edge's cache in DIR/artifacts, kept within ``--artifact-cache-size`` (default 2GiB).
It speaks HTTPS only, with the node's certificate (named by the node id); a node enrolled before node
certificates could serve TLS must re-enrol to serve devices. ``--dataset NAME=PATH`` (repeatable) names a file
or folder of this site that ``training`` tasks read.

Exit codes:
    0   stopped cleanly (SIGTERM / SIGINT; ``offline`` published)
    1   unexpected error
    2   usage: a missing or invalid option (no bootstrap token for a first start, bad node id or URL)
    3   enrolment refused by the hub (bootstrap token invalid, expired or used; node deleted; ...)
    4   the stored identity belongs to another node id, or is incomplete, or expired beyond the renewal grace
    5   the hub could not be reached for enrolment
    6   the device enrolment proxy cannot listen on an explicit --device-listen address
    7   the local store (DIR/edge.db, DIR/node-event-seq) cannot be opened
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sqlite3
import sys
from pathlib import Path
from typing import NoReturn

import click

from device.enrol import parse_ca_pin
from device.errors import ConfigError, StoredStateError
from device.renewal import START_ATTEMPTS, check_renewable, due, renew_async
from device.cli import bootstrap_token_option
from edge.agent import AgentConfig, EdgeAgent
from edge.artifacts.store import parse_size
from edge.enrol import NODE, EnrolmentError, HubUnreachable, request_certificate
from edge.enrol_proxy import ListenError, parse_listen
from edge.identity import Enrolment, IdentityError, IdentityStore
from interfaces.topics import NODE_STATE

log = logging.getLogger("aisynergy.edge")

EXIT_OK, EXIT_USAGE, EXIT_REFUSED, EXIT_IDENTITY, EXIT_UNREACHABLE, EXIT_LISTEN, EXIT_STORE = 0, 2, 3, 4, 5, 6, 7
DEFAULT_DEVICE_LISTEN = "127.0.0.1:8090"
DEFAULT_ARTIFACT_CACHE_SIZE = "2GiB"


def _fail(code: int, message: str) -> NoReturn:
    log.error("%s", message)
    sys.exit(code)


@click.group()
def edge() -> None:
    """Run the edge agent on a gateway."""


@edge.command()
@click.option("--hub", "hub_url", envvar="AISYNERGY_HUB_URL", help="hub base URL, e.g. https://hub:8000")
@click.option("--node-id", envvar="AISYNERGY_NODE_ID", required=True, help="the id the hub gave this node")
@click.option("--bootstrap-token", envvar="AISYNERGY_BOOTSTRAP_TOKEN", help="one-time token, first start only (better: the variable or --bootstrap-token-file: a command line is visible to every user)")
@click.option("--bootstrap-token-file", type=click.Path(dir_okay=False, path_type=Path), envvar="AISYNERGY_BOOTSTRAP_TOKEN_FILE", help="read the one-time token from this file (first start only: it may be gone later)")
@click.option("--ca-sha256", envvar="AISYNERGY_CA_SHA256", help="the hub CA's fingerprint (sha256:..., printed with the token), checked before the token is sent; first start only")
@click.option(
    "--data-dir",
    envvar="AISYNERGY_DATA_DIR",
    required=True,
    type=click.Path(file_okay=False, path_type=Path, resolve_path=True),
    help="identity and local state",
)
@click.option("--mqtt-url", help="override the broker URL the hub gave (mqtts://host:port)")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0.1), help="seconds; overrides the hub's value")
@click.option(
    "--downstream-mqtt-url",
    envvar="AISYNERGY_DOWNSTREAM_MQTT_URL",
    help="the devices' broker (mqtts://host:port); default: the hub's broker",
)
@click.option(
    "--device-mqtt-url",
    envvar="AISYNERGY_DEVICE_MQTT_URL",
    help="the broker URL enrolling devices are told to use; default: the downstream URL",
)
@click.option(
    "--device-listen",
    envvar="AISYNERGY_DEVICE_LISTEN",
    help=f"HOST:PORT of the device enrolment proxy, or off [default: {DEFAULT_DEVICE_LISTEN}]",
)
@click.option(
    "--artifact-cache-size",
    envvar="AISYNERGY_ARTIFACT_CACHE_SIZE",
    default=DEFAULT_ARTIFACT_CACHE_SIZE,
    show_default=True,
    help="size budget of the artefact cache served to devices (e.g. 500MiB, 2GiB)",
)
@click.option(
    "--dataset", "datasets", multiple=True, metavar="NAME=PATH",
    help="a dataset of this site (a file or a folder of files) that training tasks name; repeatable; its data never leaves the site",
)
def run(
    hub_url: str | None,
    node_id: str,
    bootstrap_token: str | None,
    bootstrap_token_file: Path | None,
    ca_sha256: str | None,
    data_dir: Path,
    mqtt_url: str | None,
    heartbeat_interval: float | None,
    downstream_mqtt_url: str | None,
    device_mqtt_url: str | None,
    device_listen: str | None,
    artifact_cache_size: str,
    datasets: tuple[str, ...],
) -> None:
    """Enrol if needed, then keep the node online until SIGTERM/SIGINT."""
    site = _datasets(datasets)
    try:
        NODE_STATE.topic(node_id=node_id)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--node-id") from None
    try:
        listen = parse_listen(device_listen or DEFAULT_DEVICE_LISTEN)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--device-listen") from None
    try:
        cache_bytes = parse_size(artifact_cache_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--artifact-cache-size") from None
    bootstrap_token = bootstrap_token_option(bootstrap_token, bootstrap_token_file, IdentityStore(data_dir).is_enrolled())
    ca_sha256 = ca_sha256 or None  # an empty variable (a compose file's default) gives none
    if ca_sha256 is not None:
        try:
            parse_ca_pin(ca_sha256)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--ca-sha256") from None
    store = IdentityStore(data_dir)
    store.secure()
    try:
        store.check_owner(node_id)
        enrolment = _enrolment(store, node_id, hub_url, bootstrap_token, ca_sha256)
        store.check_complete()
    except IdentityError as exc:
        _fail(EXIT_IDENTITY, str(exc))
    except HubUnreachable as exc:
        _fail(EXIT_UNREACHABLE, f"enrolment failed: {exc.detail}")
    except EnrolmentError as exc:
        _fail(EXIT_REFUSED, f"the hub refused enrolment ({exc.code}): {exc.detail}")
    config = AgentConfig(
        node_id=node_id,
        mqtt_url=mqtt_url or enrolment.mqtt_url,
        data_dir=data_dir,
        heartbeat_interval_s=heartbeat_interval or enrolment.heartbeat_interval_s,
        downstream_mqtt_url=downstream_mqtt_url,
        device_mqtt_url=device_mqtt_url,
        device_listen=listen,
        hub_url=enrolment.hub_url,
        artifact_cache_bytes=cache_bytes,
        datasets=site,
    )
    agent = _agent(config, store, explicit_listen=device_listen is not None)
    asyncio.run(_serve(agent))
    sys.exit(EXIT_OK)


def _datasets(options: tuple[str, ...]) -> dict[str, Path]:
    from device.tasks.site import SiteError, site_datasets

    given: dict[str, Path] = {}
    for text in options:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"takes NAME=PATH, not {text!r}", param_hint="--dataset")
        if name in given:
            raise click.BadParameter(f"dataset {name} is given twice", param_hint="--dataset")
        given[name] = Path(path)
    try:
        return site_datasets(given)
    except SiteError as exc:
        raise click.BadParameter(str(exc), param_hint="--dataset") from None


def _agent(config: AgentConfig, store: IdentityStore, explicit_listen: bool) -> EdgeAgent:
    try:
        return EdgeAgent(config)
    except ValueError as exc:  # a bad broker URL or heartbeat interval, ours or the hub's
        raise click.UsageError(
            f"{exc} (see --mqtt-url, --downstream-mqtt-url, --device-mqtt-url, --heartbeat-interval)"
        ) from None
    except ListenError as exc:
        if explicit_listen:
            _fail(EXIT_LISTEN, f"the device enrolment proxy {exc}")
        log.error("the device enrolment proxy %s; running without it (see --device-listen)", exc)
        return _agent(dataclasses.replace(config, device_listen=None), store, explicit_listen)
    except IdentityError as exc:  # an unreadable pinned signing key
        _fail(EXIT_IDENTITY, str(exc))
    except sqlite3.Error as exc:
        _fail(EXIT_STORE, f"cannot open the local store in {config.data_dir}: {exc}")
    except StoredStateError as exc:  # DIR/node-event-seq
        _fail(EXIT_STORE, str(exc))
    except OSError as exc:  # ssl.SSLError included: the key does not match the certificate
        _fail(EXIT_IDENTITY, f"cannot load the node certificate and key from {store.identity_dir}: {exc}")


def _enrolment(store: IdentityStore, node_id: str, hub_url: str | None, token: str | None, ca_sha256: str | None) -> Enrolment:
    if store.is_enrolled():
        enrolment = store.load_enrolment()
        if hub_url and hub_url.rstrip("/") != enrolment.hub_url.rstrip("/"):
            log.warning("enrolled with %s, not %s; keeping the stored identity", enrolment.hub_url, hub_url)
        log.info("using the stored identity of %s (serial %s)", node_id, enrolment.serial)
        store.check_complete()
        check_renewable(store, enrolment)
        if due(enrolment):
            enrolment = asyncio.run(renew_async(store, NODE, enrolment, attempts=START_ATTEMPTS)) or enrolment
        return enrolment
    if not hub_url or not token:
        raise click.UsageError("a first start needs --hub and --bootstrap-token (or their AISYNERGY_* variables)")
    issued = asyncio.run(request_certificate(hub_url, node_id, store.make_csr(node_id), token, ca_sha256=ca_sha256))
    return store.save(issued, hub_url)


async def _serve(agent: EdgeAgent) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop)
    await agent.run()


if __name__ == "__main__":  # python -m edge.cli, without the aisynergy root command
    logging.basicConfig(
        level=os.environ.get("AISYNERGY_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    edge()
