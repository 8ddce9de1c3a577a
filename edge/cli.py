"""``aisynergy edge``: run the edge agent.

``aisynergy edge run --hub URL --node-id ID [--bootstrap-token T] --data-dir DIR`` enrols once (CSR +
bootstrap token -> certificate, kept in DIR) and then keeps the node's MQTT session up until SIGTERM or
SIGINT. A restart with a stored certificate needs neither the token nor the hub.

Exit codes:
    0   stopped cleanly (SIGTERM / SIGINT; ``offline`` published)
    1   unexpected error
    2   usage: a missing or invalid option (no bootstrap token for a first start, bad node id or URL)
    3   enrolment refused by the hub (bootstrap token invalid, expired or used; node deleted; ...)
    4   the stored identity belongs to another node id, or is incomplete
    5   the hub could not be reached for enrolment
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import NoReturn

import click

from edge.agent import AgentConfig, EdgeAgent
from edge.enrol import EnrolmentError, HubUnreachable, request_certificate
from edge.identity import Enrolment, IdentityError, IdentityStore
from interfaces.topics import NODE_STATE

log = logging.getLogger("aisynergy.edge")

EXIT_OK, EXIT_USAGE, EXIT_REFUSED, EXIT_IDENTITY, EXIT_UNREACHABLE = 0, 2, 3, 4, 5


def _fail(code: int, message: str) -> NoReturn:
    log.error("%s", message)
    sys.exit(code)


@click.group()
def edge() -> None:
    """Run the edge agent on a gateway."""


@edge.command()
@click.option("--hub", "hub_url", envvar="AISYNERGY_HUB_URL", help="hub base URL, e.g. https://hub:8000")
@click.option("--node-id", envvar="AISYNERGY_NODE_ID", required=True, help="the id the hub gave this node")
@click.option("--bootstrap-token", envvar="AISYNERGY_BOOTSTRAP_TOKEN", help="one-time token, first start only")
@click.option(
    "--data-dir",
    envvar="AISYNERGY_DATA_DIR",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="identity and local state",
)
@click.option("--mqtt-url", help="override the broker URL the hub gave (mqtts://host:port)")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0.1), help="seconds; overrides the hub's value")
def run(
    hub_url: str | None,
    node_id: str,
    bootstrap_token: str | None,
    data_dir: Path,
    mqtt_url: str | None,
    heartbeat_interval: float | None,
) -> None:
    """Enrol if needed, then keep the node online until SIGTERM/SIGINT."""
    try:
        NODE_STATE.topic(node_id=node_id)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--node-id") from None
    data_dir.mkdir(parents=True, exist_ok=True)
    store = IdentityStore(data_dir)
    try:
        store.check_owner(node_id)
        enrolment = _enrolment(store, node_id, hub_url, bootstrap_token)
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
    )
    try:
        agent = EdgeAgent(config)
    except ValueError as exc:  # a bad broker URL or heartbeat interval, ours or the hub's
        raise click.UsageError(f"{exc} (see --mqtt-url, --heartbeat-interval)") from None
    except OSError as exc:  # ssl.SSLError included: the key does not match the certificate
        _fail(EXIT_IDENTITY, f"cannot load the node certificate and key from {store.identity_dir}: {exc}")
    asyncio.run(_serve(agent))
    sys.exit(EXIT_OK)


def _enrolment(store: IdentityStore, node_id: str, hub_url: str | None, token: str | None) -> Enrolment:
    if store.is_enrolled():
        enrolment = store.load_enrolment()
        if hub_url and hub_url.rstrip("/") != enrolment.hub_url.rstrip("/"):
            log.warning("enrolled with %s, not %s; keeping the stored identity", enrolment.hub_url, hub_url)
        log.info("using the stored identity of %s (serial %s)", node_id, enrolment.serial)
        return enrolment
    if not hub_url or not token:
        raise click.UsageError("a first start needs --hub and --bootstrap-token (or their AISYNERGY_* variables)")
    issued = asyncio.run(request_certificate(hub_url, node_id, store.make_csr(node_id), token))
    return store.save(issued, hub_url)


async def _serve(agent: EdgeAgent) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop)
    await agent.run()


if __name__ == "__main__":  # python -m edge.cli, without the aisynergy root command
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    edge()
