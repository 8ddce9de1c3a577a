"""The device's side of a deployment: carry out the orders of its desired document (DESIGN §4.2, §6).

For each order not already finished (see :mod:`device.ota.store`)::

    install:  DOWNLOADING -> DOWNLOADED -> VERIFYING -> INSTALLING -> ACTIVE
    rollback: ROLLING_BACK -> (the same steps, unreported, downgrade allowed) -> ROLLED_BACK | ROLLBACK_FAILED

The manifest's signature is checked against the pinned hub key before a byte is fetched, and the
content's size and SHA-256 before anything is installed: a failure is REJECTED with the reason and
nothing changes. So is a downgrade, unless the order says ``allow_downgrade``; the same version with the
same content is ACTIVE at once. A firmware image is read whole before its slot is written: a damaged gzip
stream or a file that does not match the digest its ``firmware.json`` records is REJECTED too, and the old
slot runs on. A delta (bsdiff4) is used when offered and its base is here; any problem with it falls back
to the full download. Models are swapped atomically in :class:`ModelHost`; applications are unpacked and
their ``current`` link switched; firmware goes to the inactive slot of ``FirmwareSlots`` and the device
reboots: the execution ends at the next start (:meth:`Updater.report_boot`), ACTIVE when the new slot
confirmed, ROLLED_BACK when the old one came back.
"""

from __future__ import annotations

import logging
import shutil
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device.ota.models import ModelHost
from device.ota.store import InstalledEntry, OtaStore
from interfaces.deployments import (
    ArtifactFormat,
    ArtifactKind,
    DeploymentOrder,
    ExecutionProgress,
    ExecutionState,
    InstalledArtifact,
    OrderAction,
    SignedManifest,
    compare_versions,
)  # fmt: skip

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from device.ota.download import Downloader
    from device.ota.firmware import BootResult, FirmwareSlots
    from device.ota.verify import TrustedKeys

log = logging.getLogger("aisynergy.device.ota")

S = ExecutionState
FORMATS = {
    ArtifactKind.MODEL: frozenset({ArtifactFormat.ONNX, ArtifactFormat.TFLITE}),
    ArtifactKind.APPLICATION: frozenset({ArtifactFormat.TAR_GZ, ArtifactFormat.ZIP, ArtifactFormat.WHEEL, ArtifactFormat.BINARY}),
    ArtifactKind.FIRMWARE: frozenset({ArtifactFormat.FIRMWARE}),
}
ProgressSink = Callable[[ExecutionProgress], None]


class _Refused(Exception):
    """Ends an execution in ``state`` with ``detail`` (nothing installed)."""

    def __init__(self, state: ExecutionState, detail: str) -> None:
        super().__init__(detail)
        self.state, self.detail = state, detail


class Updater:
    """Carries out deployment orders; :meth:`apply` runs on the device's desired worker.

    ``signing_key``: the hub's Ed25519 public key pinned at enrolment (PEM or key; ``None``: every order is
    REJECTED). ``artifact_base_url``: the API base the order paths are relative to (the edge the device
    enrolled through + ``/api/v1``). ``emit_progress`` publishes an ``ExecutionProgress``; ``firmware`` and
    ``reboot`` are needed for firmware orders; ``no_firmware`` says why a firmware order is refused without them.
    """

    def __init__(
        self,
        data_dir: str | Path,
        signing_key: TrustedKeys | Ed25519PublicKey | str | bytes | None,
        artifact_base_url: str | None,
        emit_progress: ProgressSink,
        firmware: FirmwareSlots | None = None,
        reboot: Callable[[], None] | None = None,
        *,
        models: ModelHost | None = None,
        downloader: Downloader | None = None,
        no_firmware: str = "this device has no firmware slots or no reboot handler",
        verify: ssl.SSLContext | bool = True,
        server_name: str | None = None,
    ) -> None:
        self.root = Path(data_dir) / "ota"
        self.models = models or ModelHost(self.root / "models")
        self.store = OtaStore(self.root / "state.json")
        self._signing_key: TrustedKeys | Ed25519PublicKey | str | bytes | None = signing_key  # loaded at the first order: cryptography stays out of an idle agent
        self._keys_lock = threading.Lock()
        self.signing_key_source: Callable[[], TrustedKeys | Ed25519PublicKey | None] | None = None
        """Asked for the key when none was given (an identity that pins it later); set by the owner."""
        self.pin_signing_keys: Callable[[str], None] | None = None
        """Stores the trusted keys (a PEM bundle) after a manifest led to the hub's new key; set by the owner."""
        self._base_url = artifact_base_url
        self._emit = emit_progress
        self.firmware, self.reboot = firmware, reboot
        self._downloader = downloader
        self._verify, self._server_name = verify, server_name  # how the downloads check the artefact server
        self._no_firmware = no_firmware
        self.canceled = threading.Event()

    # ---- state --------------------------------------------------------------------------------------
    def installed(self) -> dict[str, InstalledArtifact]:
        """What runs, by kind (``ReportedBody.status[INSTALLED_KEY]``)."""
        installed = {kind: entry.artifact for kind, entry in self.store.state.current.items()}
        if self.firmware is not None and (active := self.firmware.active()) is not None:
            installed[ArtifactKind.FIRMWARE.value] = active
        return installed

    def restore(self) -> None:
        """Load the installed model again after a restart (a model that no longer loads is logged)."""
        entry = self.store.state.current.get(ArtifactKind.MODEL.value)
        if entry is None:
            return
        a = entry.artifact
        try:
            self.models.activate(self.models.load(a.name, a.version, a.sha256, entry.format, Path(entry.file)))
        except Exception as exc:  # noqa: BLE001 - the device runs on without a model; the next order can fix it
            log.error("the installed model %s %s does not load: %s", a.name, a.version, exc)

    def report_boot(self, result: BootResult) -> None:
        """End the firmware execution that this start's ``FirmwareSlots.boot()`` decided (confirmed: ACTIVE;
        the old slot came back: ROLLED_BACK; for a rollback order: ROLLED_BACK or ROLLBACK_FAILED)."""
        if result.execution_id is None or result.outcome not in ("confirmed", "rolled_back"):
            return
        action = self.store.state.firmware_pending.get(result.execution_id, OrderAction.INSTALL)
        if self.store.finished(action, result.execution_id) is not None:
            return
        if action is OrderAction.ROLLBACK:
            state = S.ROLLED_BACK if result.outcome == "confirmed" else S.ROLLBACK_FAILED
        else:
            state = S.ACTIVE if result.outcome == "confirmed" else S.ROLLED_BACK
        installed = result.installed if result.installed is not None else self.installed().get(ArtifactKind.FIRMWARE.value)
        self._finish(action, ExecutionProgress(execution_id=result.execution_id, state=state, detail=result.detail[:2048], installed=installed))

    def signing_key(self) -> TrustedKeys | None:
        """The pinned hub keys (loaded on first use; ``None``: none is pinned). Raises ``ValueError`` for a
        key that does not load (:class:`~device.ota.verify.VerificationError` included)."""
        from device.ota.verify import TrustedKeys

        with self._keys_lock:
            if self._signing_key is None and self.signing_key_source is not None:
                self._signing_key = self.signing_key_source()  # pinned since this updater started (an older edge)
            if isinstance(self._signing_key, str | bytes):
                self._signing_key = TrustedKeys.from_pem(self._signing_key)
            elif self._signing_key is not None and not isinstance(self._signing_key, TrustedKeys):
                self._signing_key = TrustedKeys.of(self._signing_key)
            return self._signing_key

    def verify_manifest(self, signed: SignedManifest) -> None:
        """``signed`` is the hub's (:func:`device.ota.verify.verify_manifest`), else ``ValueError``; when its key
        transitions led to a key not pinned yet, that key is pinned too (in memory and by ``pin_signing_keys``)."""
        from device.ota.verify import verify_manifest

        keys = self.signing_key()
        if keys is None:
            raise ValueError("no hub signing key is pinned on this target (enrolled before signing keys; re-enrol)")
        trusted = verify_manifest(keys, signed)
        if trusted is keys:
            return
        with self._keys_lock:
            self._signing_key = trusted
        log.warning("the hub's signing key is %s now (a transition signed by a pinned key leads to it): pinned", signed.key_id)
        if self.pin_signing_keys is not None:
            try:
                self.pin_signing_keys(trusted.to_pem())
            except Exception as exc:  # noqa: BLE001 - trusted in memory; the next manifest leads to it again
                log.error("cannot store the hub's new signing key: %s", exc)

    def downloader(self) -> Downloader:
        """The downloader over the artefact source (also what task workers fetch their inputs with)."""
        return self._downloader_()

    # ---- orders -------------------------------------------------------------------------------------
    def apply(self, orders: list[DeploymentOrder]) -> None:
        """Carry out each order not finished yet; a finished one only reports its final state again."""
        for order in orders:
            if self.canceled.is_set():
                return
            done = self.store.finished(order.action, order.execution_id)
            if done is not None:
                log.info("execution %s already ended %s; reporting it again", order.execution_id, done.state)
                self._emit(done)
                continue
            if order.execution_id in self.store.state.firmware_pending:
                self._progress(order.execution_id, S.INSTALLING, "waiting for the reboot into the new firmware slot")
                continue
            try:
                self._carry_out(order)
            except Exception as exc:
                if self.canceled.is_set():
                    log.info("execution %s interrupted by shutdown; resumed on the next start", order.execution_id)
                    return
                log.exception("execution %s failed", order.execution_id)
                failed = S.ROLLBACK_FAILED if order.action is OrderAction.ROLLBACK else S.FAILED
                self._finish(order.action, ExecutionProgress(execution_id=order.execution_id, state=failed, detail=f"{type(exc).__name__}: {exc}"[:2048]))

    def _carry_out(self, order: DeploymentOrder) -> None:
        from device.ota.download import DownloadCanceled
        from device.ota.verify import VerificationError, verify_content

        signed, rollback = order.signed_manifest, order.action is OrderAction.ROLLBACK
        m = signed.manifest
        log.info("execution %s: %s %s %s %s", order.execution_id, order.action.value, m.kind.value, m.name, m.version)
        try:
            self._check_order(order)
            current = self.installed().get(m.kind.value)
            if rollback:
                self._progress(order.execution_id, S.ROLLING_BACK, f"reinstalling {m.name} {m.version}")
            if current is not None and current.sha256 == m.sha256:
                done = S.ROLLED_BACK if rollback else S.ACTIVE
                self._finish(order.action, ExecutionProgress(execution_id=order.execution_id, state=done, detail="already installed", installed=current))
                return
            self._progress(order.execution_id, S.DOWNLOADING, quiet=rollback)
            path, via_delta = self._obtain(order)
            self._progress(order.execution_id, S.DOWNLOADED, bytes_downloaded=m.size, via_delta=via_delta, quiet=rollback)
            self._progress(order.execution_id, S.VERIFYING, quiet=rollback)
            try:
                verify_content(signed, path)
            except VerificationError as exc:
                path.unlink(missing_ok=True)
                raise _Refused(S.REJECTED, str(exc)) from exc
            self._progress(order.execution_id, S.INSTALLING, quiet=rollback)
            installed = self._install(order, path)
        except DownloadCanceled:
            raise
        except _Refused as refused:
            state = S.ROLLBACK_FAILED if rollback else refused.state
            self._finish(order.action, ExecutionProgress(execution_id=order.execution_id, state=state, detail=refused.detail[:2048]))
            return
        if installed is None:  # firmware: the execution ends after the reboot
            return
        done = S.ROLLED_BACK if rollback else S.ACTIVE
        self._finish(order.action, ExecutionProgress(execution_id=order.execution_id, state=done, installed=installed, via_delta=via_delta))

    def _check_order(self, order: DeploymentOrder) -> None:
        """Signature, kind and downgrade: REJECTED before anything is downloaded."""
        signed = order.signed_manifest
        m = signed.manifest
        try:
            if self.signing_key() is None:
                raise _Refused(S.REJECTED, "no hub signing key is pinned on this device (enrolled before signing keys; re-enrol)")
            self.verify_manifest(signed)
        except ValueError as exc:  # VerificationError included
            raise _Refused(S.REJECTED, str(exc)) from exc
        if m.format not in FORMATS[m.kind]:
            raise _Refused(S.REJECTED, f"incompatible: a {m.kind.value} cannot have format {m.format.value}")
        if m.kind is ArtifactKind.FIRMWARE and (self.firmware is None or self.reboot is None):
            raise _Refused(S.REJECTED, f"incompatible: {self._no_firmware}")
        current = self.installed().get(m.kind.value)
        if current is None or current.name != m.name or order.allow_downgrade or order.action is OrderAction.ROLLBACK:
            return
        older = compare_versions(m.version, current.version)
        if older < 0:
            raise _Refused(S.REJECTED, f"downgrade from {m.name} {current.version} to {m.version} refused (the deployment does not allow_downgrade)")
        if older == 0 and current.sha256 != m.sha256:
            raise _Refused(S.REJECTED, f"{m.name} {m.version} is installed with other content (SHA-256 {current.sha256})")

    def _obtain(self, order: DeploymentOrder) -> tuple[Path, bool]:
        """The artefact's bytes on disk: kept locally (a rollback), rebuilt from a delta, or downloaded."""
        from device.ota.delta import DeltaError, rebuild_from_delta
        from device.ota.download import DownloadError

        m = order.signed_manifest.manifest
        local = self._local_file(m.sha256)
        if local is not None:
            staged = self._downloader_().part_path(m.sha256)
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, staged)
            log.info("%s %s is kept on this device; not downloading it", m.name, m.version)
            return staged, False
        if self._base_url is None:
            raise _Refused(S.FAILED, "no artefact source known (no enrolment URL on a device, no hub URL on an edge)")
        downloader = self._downloader_()
        if order.delta is not None:
            try:
                return rebuild_from_delta(downloader, order.delta, order.token, self._delta_base(m.kind, order.delta.base_sha256), order.signed_manifest), True
            except DeltaError as exc:
                log.warning("delta for %s %s not used (%s); downloading the full artefact", m.name, m.version, exc)
        try:
            return downloader.fetch(order.path, order.token, m.sha256, m.size), False
        except DownloadError as exc:
            if self.canceled.is_set():
                raise
            raise _Refused(S.FAILED, f"download failed: {exc}") from exc

    def _install(self, order: DeploymentOrder, path: Path) -> InstalledArtifact | None:
        from device.ota.apps import AppInstallError, install_app
        from device.ota.models import ModelLoadError

        signed = order.signed_manifest
        m = signed.manifest
        installed = InstalledArtifact(name=m.name, version=m.version, sha256=m.sha256, artifact_id=order.artifact_id)
        if m.kind is ArtifactKind.FIRMWARE:
            from device.ota.verify import VerificationError

            assert self.firmware is not None and self.reboot is not None
            self.store.firmware_waits(order.execution_id, order.action)
            try:
                self.firmware.install(path, signed, order.execution_id, order.confirm_timeout_s)
            except VerificationError as exc:  # the signed bytes hold a bad image: nothing was written
                raise _Refused(S.REJECTED, f"firmware image refused: {exc}") from exc
            except Exception as exc:
                raise _Refused(S.FAILED, f"firmware install failed: {type(exc).__name__}: {exc}") from exc
            finally:
                path.unlink(missing_ok=True)
            log.info("firmware %s %s written to the inactive slot; rebooting", m.name, m.version)
            self.reboot()
            return None
        if m.kind is ArtifactKind.MODEL:
            keep = frozenset(Path(e.file) for e in self._entries(m.kind))
            try:
                model = self.models.install(m.name, m.version, m.sha256, m.format, path, keep=keep)
            except ModelLoadError as exc:
                raise _Refused(S.FAILED, str(exc)) from exc
            finally:
                path.unlink(missing_ok=True)
            kept = model.path
        else:
            app_root = self.root / "apps"
            kept = app_root / m.name / f"{m.sha256}.{m.format.value}"
            kept.parent.mkdir(parents=True, exist_ok=True)
            try:
                install_app(app_root, m.name, m.version, m.format, path)
            except AppInstallError as exc:
                path.unlink(missing_ok=True)
                raise _Refused(S.FAILED, str(exc)) from exc
            shutil.move(path, kept)
        self.store.installed(m.kind.value, InstalledEntry(artifact=installed, format=m.format, file=str(kept)))
        self._prune(m.kind)
        return installed

    # ---- files --------------------------------------------------------------------------------------
    def _entries(self, kind: ArtifactKind) -> list[InstalledEntry]:
        state = self.store.state
        return [e for e in (state.current.get(kind.value), state.previous.get(kind.value)) if e is not None]

    def _local_file(self, sha256: str) -> Path | None:
        state = self.store.state
        for entry in [*state.current.values(), *state.previous.values()]:
            if entry.artifact.sha256 == sha256 and Path(entry.file).exists():
                return Path(entry.file)
        return None

    def _delta_base(self, kind: ArtifactKind, base_sha256: str) -> Path | None:
        if kind is ArtifactKind.FIRMWARE:
            return self.firmware.active_image() if self.firmware is not None else None
        return self._local_file(base_sha256)

    def _prune(self, kind: ArtifactKind) -> None:
        """Application archives other than the current and previous one's go (models prune themselves)."""
        if kind is not ArtifactKind.APPLICATION:
            return
        keep = {Path(e.file) for e in self._entries(kind)}
        for name_dir in (self.root / "apps").iterdir():
            for f in name_dir.iterdir():
                if f.is_file() and not f.is_symlink() and not f.name.startswith(".") and f not in keep:
                    f.unlink(missing_ok=True)

    def _downloader_(self) -> Downloader:
        if self._downloader is None:
            from device.ota.download import Downloader

            self._downloader = Downloader(
                self._base_url or "", self.root / "partial", verify=self._verify, server_name=self._server_name, canceled=self.canceled
            )
        return self._downloader

    # ---- progress -----------------------------------------------------------------------------------
    def _progress(self, execution_id: str, state: ExecutionState, detail: str = "", *, quiet: bool = False, **extra: Any) -> None:
        if not quiet:
            self._emit(ExecutionProgress(execution_id=execution_id, state=state, detail=detail, **extra))

    def _finish(self, action: OrderAction, progress: ExecutionProgress) -> None:
        self.store.finish(action, progress)
        log.info("execution %s: %s %s", progress.execution_id, progress.state.value, progress.detail)
        self._emit(progress)
