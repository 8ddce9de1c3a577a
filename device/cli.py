"""``aisynergy device``: run the device agent.

``aisynergy device run --device-id ID --data-dir DIR [--enrol-url URL --bootstrap-token T]`` enrols once
(CSR + bootstrap token -> certificate, kept in DIR; the enrolment URL is the device's edge, or the hub),
executes itself again (the same process id; the agent then runs from the stored identity, without the
enrolment's HTTP client and CSR code in its memory) and then keeps the device's MQTT session up until SIGTERM or SIGINT. A restart with a stored
certificate needs neither the token nor the enrolment endpoint. ``--emit-every S`` makes it a demo or
load device that emits an event (``--emit-type``, data ``{"count": n}``) every S seconds.

Firmware (:mod:`device.ota.firmware`): every start first boots the firmware slots in DIR/firmware (a
pending slot runs its health check and is committed or rolled back) and hands the result to the Device;
``Device.reboot()`` disconnects cleanly and re-executes this process, which boots the slot just installed.
``--firmware IMAGE --firmware-manifest M --firmware-public-key P`` provisions a factory image into slot a
when no firmware is installed yet (ignored afterwards).

``--dataset NAME=PATH.npz`` (repeatable) keeps a local dataset (arrays ``x``, ``y``) on the device for training
tasks: it is copied into DIR/datasets and its description (never its rows) reported to the hub.

Exit codes:
    0   stopped cleanly (SIGTERM / SIGINT; ``offline`` published)
    1   unexpected error
    2   usage: a missing or invalid option (no bootstrap token for a first start, bad device id or URL)
    3   enrolment refused (bootstrap token invalid, expired or used; device deleted; ...)
    4   the stored identity belongs to another device id, or the data directory holds unusable files
    5   the enrolment endpoint could not be reached
    6   the factory firmware image (--firmware) was rejected: bad signature, or not what its manifest says
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import click

from device.agent import Device
from device.errors import ConfigError, EnrolmentError, EnrolmentUnreachable, NotRunning, OutboxFull, StoredStateError
from device.files import read_secret
from device.identity import IdentityStore
from device.local_data import DatasetError
from device.ota.firmware import BootResult, FirmwareError, FirmwareSlots
from device.ota.verify import TrustedKeys, VerificationError, verify_manifest
from interfaces.deployments import SignedManifest

log = logging.getLogger("aisynergy.device")

EXIT_OK, EXIT_USAGE, EXIT_REFUSED, EXIT_STORED_STATE, EXIT_UNREACHABLE, EXIT_FIRMWARE_REJECTED = 0, 2, 3, 4, 5, 6
FIRMWARE_DIR = "firmware"
EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


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
    type=click.Path(file_okay=False, path_type=Path, resolve_path=True),
    help="identity and local state",
)
@click.option("--enrol-url", envvar="AISYNERGY_ENROL_URL", help="the edge (or hub) base URL, first start only")
@click.option("--bootstrap-token", envvar="AISYNERGY_BOOTSTRAP_TOKEN", help="one-time token, first start only (better: the variable or --bootstrap-token-file: a command line is visible to every user)")
@click.option("--bootstrap-token-file", type=click.Path(dir_okay=False, path_type=Path), envvar="AISYNERGY_BOOTSTRAP_TOKEN_FILE", help="read the one-time token from this file (first start only: it may be gone later)")
@click.option("--ca-sha256", envvar="AISYNERGY_CA_SHA256", help="the hub CA's fingerprint (sha256:...), checked before the token is sent; first start only")
@click.option("--tls-server-name", envvar="AISYNERGY_TLS_SERVER_NAME", help="the name in the enrolment server's certificate (an edge: its node id); first start only")
@click.option("--mqtt-url", help="override the broker URL from enrolment (mqtts://host:port)")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0.1), help="seconds; overrides enrolment's value")
@click.option("--emit-every", type=click.FloatRange(min=0.001), help="demo/load: emit an event every S seconds")
@click.option("--emit-type", default="demo", show_default=True, help="the type of the --emit-every events")
@click.option("--firmware", "firmware_image", type=EXISTING_FILE, help="factory firmware image, provisioned when none is installed")
@click.option("--firmware-manifest", type=EXISTING_FILE, help="the signed manifest of --firmware")
@click.option("--firmware-public-key", type=EXISTING_FILE, help="the Ed25519 public key (PEM) that signed --firmware-manifest")
@click.option("--dataset", "datasets", multiple=True, metavar="NAME=PATH", help="keep a local dataset (.npz with x, y) for training tasks; repeatable")
def run(
    device_id: str,
    data_dir: Path,
    enrol_url: str | None,
    bootstrap_token: str | None,
    bootstrap_token_file: Path | None,
    ca_sha256: str | None,
    tls_server_name: str | None,
    mqtt_url: str | None,
    heartbeat_interval: float | None,
    emit_every: float | None,
    emit_type: str,
    firmware_image: Path | None,
    firmware_manifest: Path | None,
    firmware_public_key: Path | None,
    datasets: tuple[str, ...],
) -> None:
    """Enrol if needed, then keep the device online until SIGTERM/SIGINT."""
    factory = (firmware_image, firmware_manifest, firmware_public_key)
    if any(factory) and not all(factory):
        raise click.UsageError("--firmware, --firmware-manifest and --firmware-public-key go together")
    local = [_dataset_option(text) for text in datasets]
    bootstrap_token = bootstrap_token_option(bootstrap_token, bootstrap_token_file, IdentityStore(data_dir).is_enrolled())
    ca_sha256 = ca_sha256 or None  # an empty variable (a compose file's default) gives none
    firmware_boot = _boot_firmware(data_dir / FIRMWARE_DIR, *factory)  # type: ignore[arg-type]
    with _exits():
        # a first start enrols, then starts afresh (booting the slots again finds them booted): the agent's process
        # never holds the enrolment's libraries
        trust = {"ca_sha256": ca_sha256, "tls_server_name": tls_server_name}
        if Device(device_id, data_dir, enrol_url, bootstrap_token, mqtt_url, heartbeat_interval, **trust).enrol():
            _reexecute("enrolled; starting the agent")
    with _exits():
        agent = Device(
            device_id, data_dir, enrol_url, bootstrap_token, mqtt_url, heartbeat_interval, reboot=_reexecute, firmware_boot=firmware_boot
        )
        for name, path in local:
            try:
                agent.datasets.add(name, path)
            except DatasetError as exc:
                raise click.UsageError(f"--dataset {name}={path}: {exc}") from None
        agent.start()
    if emit_every:
        threading.Thread(
            target=_emit_forever, args=(agent, emit_type, emit_every), name="demo-emitter", daemon=True
        ).start()
    agent.run_forever()
    sys.exit(EXIT_OK)


def bootstrap_token_option(token: str | None, token_file: Path | None, enrolled: bool) -> str | None:
    """``--bootstrap-token`` or what ``--bootstrap-token-file`` holds (read only for a first start: the file may be
    gone later); the options exclude each other. Also the edge's (``aisynergy edge run``)."""
    if token_file is not None and token:
        raise click.UsageError("--bootstrap-token and --bootstrap-token-file exclude each other")
    if token_file is None or enrolled:
        return token
    try:
        return read_secret(token_file, "--bootstrap-token-file")
    except (OSError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None


@contextlib.contextmanager
def _exits() -> Iterator[None]:
    """The agent's start-up errors as this command's exit statuses (see the module docstring)."""
    try:
        yield
    except ConfigError as exc:
        raise click.UsageError(f"{exc} (see --device-id, --enrol-url, --bootstrap-token, --ca-sha256, --mqtt-url)") from None
    except StoredStateError as exc:
        _fail(EXIT_STORED_STATE, str(exc))
    except EnrolmentUnreachable as exc:
        _fail(EXIT_UNREACHABLE, f"enrolment failed: {exc.detail}")
    except EnrolmentError as exc:
        _fail(EXIT_REFUSED, f"enrolment refused ({exc.code}): {exc.detail}")


def _dataset_option(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise click.UsageError(f"--dataset takes NAME=PATH, not {text!r}")
    if not Path(path).is_file():
        raise click.UsageError(f"--dataset {name}: no file {path}")
    return name, Path(path)


def _boot_firmware(root: Path, image: Path | None, manifest: Path | None, public_key: Path | None) -> BootResult:
    """Provision the factory image if asked and none is installed, then boot the firmware slots."""
    slots = FirmwareSlots(root)
    try:
        if image is not None and manifest is not None and public_key is not None:
            if slots.active() is None:
                try:
                    signed = SignedManifest.model_validate_json(manifest.read_bytes())
                    verify_manifest(TrustedKeys.from_pem(public_key.read_bytes()), signed)
                    slots.provision(image, signed)
                except (ValueError, VerificationError) as exc:  # pydantic's ValidationError included
                    _fail(EXIT_FIRMWARE_REJECTED, f"factory firmware {image} rejected: {str(exc).splitlines()[0]}")
            else:
                log.info("firmware already installed; --firmware ignored")
        result = slots.boot()
    except (FirmwareError, OSError) as exc:
        _fail(EXIT_STORED_STATE, f"firmware slots in {root} unusable: {exc}")
    if result.installed is not None:
        log.info("firmware %s %s from slot %s (%s)", result.installed.name, result.installed.version, result.slot, result.outcome)
    if result.outcome == "rolled_back":
        log.warning("firmware execution %s rolled back: %s", result.execution_id, result.detail)
    return result


def _reexecute(why: str = "restarting to boot the installed firmware") -> None:
    """The reboot hook: the same interpreter, options and arguments again, so the new slot boots."""
    log.info("%s", why)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


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
