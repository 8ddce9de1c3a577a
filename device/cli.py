"""``aisynergy device``: run the device agent.

``aisynergy device run --device-id ID --data-dir DIR [--enrol-url URL --bootstrap-token T]`` enrols once
(CSR + bootstrap token -> certificate, kept in DIR; the enrolment URL is the device's edge, or the hub)
and then keeps the device's MQTT session up until SIGTERM or SIGINT. A restart with a stored
certificate needs neither the token nor the enrolment endpoint. ``--emit-every S`` makes it a demo or
load device that emits an event (``--emit-type``, data ``{"count": n}``) every S seconds.

Exit codes:
    0   stopped cleanly (SIGTERM / SIGINT; ``offline`` published)
    1   unexpected error
    2   usage: a missing or invalid option (no bootstrap token for a first start, bad device id or URL)
    3   enrolment refused (bootstrap token invalid, expired or used; device deleted; ...)
    4   the stored identity belongs to another device id, or the data directory holds unusable files
    5   the enrolment endpoint could not be reached
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import click

from device.agent import Device
from device.errors import ConfigError, EnrolmentError, EnrolmentUnreachable, NotRunning, OutboxFull, StoredStateError

log = logging.getLogger("aisynergy.device")

EXIT_OK, EXIT_USAGE, EXIT_REFUSED, EXIT_STORED_STATE, EXIT_UNREACHABLE = 0, 2, 3, 4, 5


def _fail(code: int, message: str) -> NoReturn:
    log.error("%s", message)
    sys.exit(code)


@click.group()
def device() -> None:
    """Run the device agent on a board."""


@device.command()
@click.option("--device-id", envvar="AISYNERGY_DEVICE_ID", required=True, help="the id the hub gave this device")
@click.option(
    "--data-dir",
    envvar="AISYNERGY_DATA_DIR",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="identity and local state",
)
@click.option("--enrol-url", envvar="AISYNERGY_ENROL_URL", help="the edge (or hub) base URL, first start only")
@click.option("--bootstrap-token", envvar="AISYNERGY_BOOTSTRAP_TOKEN", help="one-time token, first start only")
@click.option("--mqtt-url", help="override the broker URL from enrolment (mqtts://host:port)")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0.1), help="seconds; overrides enrolment's value")
@click.option("--emit-every", type=click.FloatRange(min=0.001), help="demo/load: emit an event every S seconds")
@click.option("--emit-type", default="demo", show_default=True, help="the type of the --emit-every events")
def run(
    device_id: str,
    data_dir: Path,
    enrol_url: str | None,
    bootstrap_token: str | None,
    mqtt_url: str | None,
    heartbeat_interval: float | None,
    emit_every: float | None,
    emit_type: str,
) -> None:
    """Enrol if needed, then keep the device online until SIGTERM/SIGINT."""
    try:
        agent = Device(device_id, data_dir, enrol_url, bootstrap_token, mqtt_url, heartbeat_interval)
        agent.start()
    except ConfigError as exc:
        raise click.UsageError(f"{exc} (see --device-id, --enrol-url, --bootstrap-token, --mqtt-url)") from None
    except StoredStateError as exc:
        _fail(EXIT_STORED_STATE, str(exc))
    except EnrolmentUnreachable as exc:
        _fail(EXIT_UNREACHABLE, f"enrolment failed: {exc.detail}")
    except EnrolmentError as exc:
        _fail(EXIT_REFUSED, f"enrolment refused ({exc.code}): {exc.detail}")
    if emit_every:
        threading.Thread(
            target=_emit_forever, args=(agent, emit_type, emit_every), name="demo-emitter", daemon=True
        ).start()
    agent.run_forever()
    sys.exit(EXIT_OK)


def _emit_forever(agent: Device, event_type: str, every_s: float) -> None:
    count, due = 0, time.monotonic()
    while True:
        due += every_s  # a fixed schedule, so that a load test's rate does not drift
        time.sleep(max(0.0, due - time.monotonic()))
        try:
            agent.emit(event_type, {"count": count})
        except NotRunning:
            return
        except OutboxFull as exc:
            log.warning("%s", exc)
        count += 1


if __name__ == "__main__":  # python -m device.cli, without the aisynergy root command
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device()
