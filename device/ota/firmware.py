"""Firmware A/B slots with a boot counter and commit-after-boot (U-Boot ``bootcount`` style; DESIGN §4.2).

Layout under ``root`` (``<device data dir>/firmware``)::

    boot.json         {"active": "a", "installed": {...}, "pending": {...} | null, "last": {...}}
    installing.json   marker, present only while install() writes a slot
    a/  b/            a slot: content/ (the unpacked image: what the agent runs from), image.fw (the image
                      itself, the base of the next delta), slot.json (its signed manifest)

Every state change is one atomic, fsynced write of ``boot.json``; a slot directory appears by one rename
of a complete temporary directory, so after a ``kill -9`` or a power cut at any point the device boots a
slot that is complete and was confirmed once, and every execution ends ACTIVE or ROLLED_BACK.

install(image, signed, execution_id, confirm_timeout_s)
    Writes ``installing.json`` {execution_id, slot}, unpacks the image into a temporary directory, moves it
    into the INACTIVE slot, and only then writes ``boot.json`` with ``pending`` {slot, execution_id,
    installed, confirm_deadline (Unix time), boot_count: 0, max_boots: 1}. The running slot is untouched;
    the caller then restarts the agent (``Device.reboot``).
boot()
    Called once at every agent start, before the agent runs from :meth:`FirmwareSlots.slot_dir`.

    * ``installing.json`` without a matching ``pending``: an install was interrupted. Its slot is removed
      and the result is ``rolled_back`` with its execution id; the old slot keeps running.
    * ``pending``: ``boot_count`` is incremented and persisted BEFORE the health check runs. When it then
      exceeds ``max_boots``, an earlier boot of this slot never confirmed (killed during confirmation, a
      crash, a power cut): the slot is abandoned -> old slot, ``rolled_back``. Past ``confirm_deadline``:
      abandoned too. Otherwise the health check of ``firmware.json`` runs in the slot's content (timeout:
      the smaller of its own and the time left to the deadline): exit 0 commits the slot (``active`` =
      pending slot) -> ``confirmed``; a failure or timeout abandons it -> ``rolled_back`` with the reason.
    * otherwise ``normal`` (a confirmed slot runs) or ``none`` (no firmware was ever installed).

``provision(image, signed)`` is the factory path: the first image, straight into slot ``a``, active.
The deadline is wall-clock time, so it holds across restarts (a clock jump can shorten or lengthen it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from device.errors import DeviceError
from device.files import write_atomic
from device.ota.firmware_image import FIRMWARE_JSON, FirmwareInfo, ImageError, fsync_tree, unpack_image
from device.ota.verify import verify_content
from interfaces.deployments import ArtifactFormat, ArtifactKind, InstalledArtifact, SignedManifest

log = logging.getLogger("aisynergy.device.firmware")

Slot = Literal["a", "b"]
Outcome = Literal["none", "normal", "confirmed", "rolled_back"]
STATE_FILE = "boot.json"
MARKER_FILE = "installing.json"
CONTENT_DIR = "content"
IMAGE_FILE = "image.fw"
SLOT_FILE = "slot.json"
MAX_BOOTS = 1
HEALTH_OUTPUT_CHARS = 500


class FirmwareError(DeviceError):
    """The slots cannot do what was asked (an install already waits for its boot, state unreadable, ...)."""


@dataclass(frozen=True)
class BootResult:
    slot: str | None
    installed: InstalledArtifact | None
    outcome: Outcome
    execution_id: str | None
    detail: str


class _Pending(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slot: Slot
    execution_id: str
    installed: InstalledArtifact
    confirm_deadline: float
    boot_count: int = Field(default=0, ge=0)
    max_boots: int = Field(default=MAX_BOOTS, ge=1)


class _Last(BaseModel):
    """The latest install's outcome, for diagnostics (``aisynergy firmware`` users reading boot.json)."""

    execution_id: str
    outcome: Literal["confirmed", "rolled_back"]
    detail: str
    at: datetime


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid")

    active: Slot | None = None
    installed: InstalledArtifact | None = None
    pending: _Pending | None = None
    last: _Last | None = None


class _Marker(BaseModel):
    execution_id: str
    slot: Slot


class FirmwareSlots:
    """Two firmware slots under ``root``; see the module docstring for the boot protocol."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()

    # ---- queries ------------------------------------------------------------------------------------
    def active(self) -> InstalledArtifact | None:
        """What the running (confirmed) slot holds; None before any firmware was installed."""
        return self._load().installed

    def active_image(self) -> Path | None:
        """The running slot's image file (the base of a delta update)."""
        state = self._load()
        return self.root / state.active / IMAGE_FILE if state.active else None

    def slot_dir(self) -> Path | None:
        """The running slot's unpacked content: what the agent runs from."""
        state = self._load()
        return self.root / state.active / CONTENT_DIR if state.active else None

    # ---- install ------------------------------------------------------------------------------------
    def provision(self, image: Path, signed: SignedManifest, *, artifact_id: str | None = None) -> InstalledArtifact:
        """Factory install: ``image`` into slot ``a``, active at once (no firmware may be installed yet)."""
        with self._lock:
            state = self._load()
            if state.active is not None or state.pending is not None:
                raise FirmwareError("firmware is already installed; updates go through install()")
            self.root.mkdir(parents=True, exist_ok=True)
            installed = self._write_slot("a", image, signed, artifact_id)
            self._save(_State(active="a", installed=installed))
            log.info("provisioned firmware %s %s in slot a", installed.name, installed.version)
            return installed

    def install(
        self, image: Path, signed: SignedManifest, execution_id: str, confirm_timeout_s: float, *, artifact_id: str | None = None
    ) -> None:
        """Write the verified ``image`` into the inactive slot and make it pending; the next boot() tries it.

        ``signed`` must already have been verified against the pinned key; the image is checked against it
        (size, SHA-256, kind, name and version) here, and read whole before the slot is written: a damaged
        gzip stream or a file that does not match its digest in ``firmware.json`` is an ``ImageError``
        (:mod:`device.ota.firmware_image`). Raises :class:`~device.ota.verify.VerificationError`
        (``ImageError`` included) for an image to REJECT, :class:`FirmwareError` when an install waits.
        """
        if confirm_timeout_s <= 0:
            raise ValueError(f"confirm_timeout_s must be positive, not {confirm_timeout_s}")
        with self._lock:
            state = self._load()
            if state.pending is not None:
                raise FirmwareError(f"execution {state.pending.execution_id} waits for its boot; restart the agent first")
            slot: Slot = "b" if state.active == "a" else "a"
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / MARKER_FILE, _Marker(execution_id=execution_id, slot=slot).model_dump_json().encode())
            try:
                installed = self._write_slot(slot, image, signed, artifact_id)  # cleans up after itself on failure
            except BaseException:
                (self.root / MARKER_FILE).unlink(missing_ok=True)
                raise
            pending = _Pending(slot=slot, execution_id=execution_id, installed=installed, confirm_deadline=time.time() + confirm_timeout_s)
            self._save(state.model_copy(update={"pending": pending}))
            (self.root / MARKER_FILE).unlink(missing_ok=True)
            log.info("firmware %s %s written to slot %s; pending its boot (execution %s)", installed.name, installed.version, slot, execution_id)

    def _write_slot(self, slot: Slot, image: Path, signed: SignedManifest, artifact_id: str | None) -> InstalledArtifact:
        manifest = signed.manifest
        if manifest.kind is not ArtifactKind.FIRMWARE or manifest.format is not ArtifactFormat.FIRMWARE:
            raise ImageError(f"the manifest is for a {manifest.kind} in format {manifest.format}, not a firmware image")
        verify_content(signed, image)
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".tmp-{slot}-"))
        try:
            info = unpack_image(image, tmp / CONTENT_DIR)
            _check_matches(info, signed)
            with open(image, "rb") as source, open(tmp / IMAGE_FILE, "xb") as out:
                shutil.copyfileobj(source, out, 1024 * 1024)
                out.flush()
                os.fsync(out.fileno())
            verify_content(signed, tmp / IMAGE_FILE)  # the image may have changed while it was copied
            installed = InstalledArtifact(name=manifest.name, version=manifest.version, sha256=manifest.sha256, artifact_id=artifact_id, slot=slot)
            slot_doc = {"installed": installed.model_dump(mode="json"), "signed_manifest": signed.model_dump(mode="json")}
            write_atomic(tmp / SLOT_FILE, json.dumps(slot_doc).encode())
            fsync_tree(tmp)
            self._remove(slot)
            os.rename(tmp, self.root / slot)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return installed

    # ---- boot ---------------------------------------------------------------------------------------
    def boot(self) -> BootResult:
        """Decide which slot runs; call it once at every agent start (see the module docstring)."""
        with self._lock:
            if not self.root.exists():
                return BootResult(None, None, "none", None, "no firmware installed")
            state = self._load()
            interrupted = self._recover(state)
            if state.pending is not None:
                return self._try_pending(state)
            if interrupted is not None:
                detail = f"the install into slot {interrupted.slot} was interrupted; slot {state.active} kept"
                log.warning("execution %s: %s", interrupted.execution_id, detail)
                last = _Last(execution_id=interrupted.execution_id, outcome="rolled_back", detail=detail, at=_now())
                state = state.model_copy(update={"last": last})
                self._save(state)
                (self.root / MARKER_FILE).unlink(missing_ok=True)  # after the save: reported again rather than lost
                return BootResult(state.active, state.installed, "rolled_back", interrupted.execution_id, detail)
            if state.active is None:
                return BootResult(None, None, "none", None, "no firmware installed")
            assert state.installed is not None
            running = f"{state.installed.name} {state.installed.version} from slot {state.active}"
            return BootResult(state.active, state.installed, "normal", None, running)

    def _recover(self, state: _State) -> _Marker | None:
        """Remove what an interrupted install or removal left; the interrupted install's marker, if any
        (the caller removes that marker once it recorded the outcome)."""
        marker: _Marker | None = None
        path = self.root / MARKER_FILE
        if path.exists():
            try:
                marker = _Marker.model_validate_json(path.read_bytes())
            except (ValidationError, OSError) as exc:
                log.warning("unreadable install marker (%s); removing it", exc)
            if marker is not None and state.pending is not None and state.pending.execution_id == marker.execution_id:
                marker = None  # the install finished: killed just before it removed the marker
            if marker is not None and marker.slot != state.active:
                self._remove(marker.slot)
        for leftover in self.root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in self.root.glob(".trash-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if marker is None:
            path.unlink(missing_ok=True)
        return marker

    def _try_pending(self, state: _State) -> BootResult:
        pending = state.pending
        assert pending is not None
        pending = pending.model_copy(update={"boot_count": pending.boot_count + 1})
        state = state.model_copy(update={"pending": pending})
        self._save(state)  # before the health check: a boot that never confirms is counted
        name = f"{pending.installed.name} {pending.installed.version} in slot {pending.slot}"
        left = pending.confirm_deadline - time.time()
        if pending.boot_count > pending.max_boots:
            return self._abandon(state, f"{name} did not confirm in {pending.max_boots} boot(s) (boot {pending.boot_count})")
        if left <= 0:
            return self._abandon(state, f"{name} booted after its confirm deadline")
        content = self.root / pending.slot / CONTENT_DIR
        try:
            info = FirmwareInfo.model_validate_json((content / FIRMWARE_JSON).read_bytes())
        except (ValidationError, OSError) as exc:
            return self._abandon(state, f"{name}: slot unreadable ({exc})")
        ok, detail = run_health_check(info, content, min(info.health.timeout_s, left))
        if not ok:
            return self._abandon(state, f"{name}: health check {detail}")
        installed = pending.installed
        last = _Last(execution_id=pending.execution_id, outcome="confirmed", detail=f"{name} confirmed", at=_now())
        self._save(_State(active=pending.slot, installed=installed, pending=None, last=last))
        log.info("execution %s: %s booted and confirmed", pending.execution_id, name)
        return BootResult(pending.slot, installed, "confirmed", pending.execution_id, f"{name} booted and passed its health check")

    def _abandon(self, state: _State, reason: str) -> BootResult:
        pending = state.pending
        assert pending is not None
        back = f"; back on slot {state.active}" if state.active else "; no slot to go back to"
        last = _Last(execution_id=pending.execution_id, outcome="rolled_back", detail=reason + back, at=_now())
        self._save(state.model_copy(update={"pending": None, "last": last}))
        self._remove(pending.slot)
        log.warning("execution %s: %s%s", pending.execution_id, reason, back)
        return BootResult(state.active, state.installed, "rolled_back", pending.execution_id, reason + back)

    # ---- files --------------------------------------------------------------------------------------
    def _load(self) -> _State:
        path = self.root / STATE_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return _State()
        except OSError as exc:
            raise FirmwareError(f"cannot read {path}: {exc}") from exc
        try:
            return _State.model_validate_json(raw)
        except ValidationError as exc:
            raise FirmwareError(f"{path} is not a valid boot state: {exc}") from exc

    def _save(self, state: _State) -> None:
        write_atomic(self.root / STATE_FILE, state.model_dump_json(indent=2).encode())

    def _remove(self, slot: Slot) -> None:
        """Remove a slot directory; a rename first, so that a slot is never seen half removed."""
        path = self.root / slot
        if not path.exists():
            return
        trash = Path(tempfile.mkdtemp(dir=self.root, prefix=f".trash-{slot}-"))
        os.rename(path, trash / slot)
        _fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)


def run_health_check(info: FirmwareInfo, content: Path, timeout_s: float) -> tuple[bool, str]:
    """Run ``info.health.argv`` in ``content``; (True, "") on exit 0 within ``timeout_s``, else (False, why).

    ``python3`` or ``python`` as ``argv[0]`` is the agent's own interpreter. The check runs in its own
    process group, killed whole on timeout.
    """
    argv = list(info.health.argv)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    env = {**os.environ, "AISYNERGY_FIRMWARE_NAME": info.name, "AISYNERGY_FIRMWARE_VERSION": info.version}
    try:
        proc = subprocess.Popen(
            argv, cwd=content, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
    except OSError as exc:
        return False, f"could not start: {exc}"
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return False, f"timed out after {timeout_s:.1f} s"
    except BaseException:
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        tail = output.decode(errors="replace").strip()[-HEALTH_OUTPUT_CHARS:]
        return False, f"failed (exit {proc.returncode}){': ' + tail if tail else ''}"
    return True, ""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _check_matches(info: FirmwareInfo, signed: SignedManifest) -> None:
    manifest = signed.manifest
    if (info.name, info.version) != (manifest.name, manifest.version):
        raise ImageError(f"the image says {info.name} {info.version}; the manifest {manifest.name} {manifest.version}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _now() -> datetime:
    return datetime.now(UTC)
