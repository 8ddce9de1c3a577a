"""The device's updater without a broker: signed orders against a local artefact server."""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import bsdiff4
import numpy as np
import onnxruntime as ort
import pytest

from cloud.signing import SigningKey
from device.ota.download import Downloader
from device.ota.models import ModelHost
from device.ota.updater import Updater
from interfaces.deployments import ArtifactFormat, ArtifactKind, ExecutionProgress, ExecutionState, OrderAction
from tests.device.ota_support import V1, V2, BlobServer, blob_server, make_order, offer_delta

S = ExecutionState
X = np.random.default_rng(5).standard_normal((4, 128)).astype(np.float32)


def expected(model: bytes) -> np.ndarray:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return SigningKey.load_or_create(tmp_path_factory.mktemp("hub-pki"))


@pytest.fixture
def server() -> Iterator[BlobServer]:
    with blob_server() as s:
        yield s


class Target:
    """An Updater on ``data_dir`` and the progress it emitted."""

    def __init__(self, data_dir: Path, signing_pem: str, server: BlobServer) -> None:
        self.events: list[ExecutionProgress] = []
        self.updater = Updater(
            data_dir,
            signing_pem,
            server.base_url,
            self.events.append,
            models=ModelHost(data_dir / "ota" / "models", threads=1),
            downloader=Downloader(server.base_url, data_dir / "ota" / "partial", attempts=4, max_delay_s=0.05),
        )
        self.updater.restore()

    def states(self, execution_id: str) -> list[ExecutionState]:
        return [e.state for e in self.events if e.execution_id == execution_id]

    def final(self, execution_id: str) -> ExecutionProgress:
        return [e for e in self.events if e.execution_id == execution_id][-1]

    def infer(self) -> tuple[np.ndarray, str]:
        result = self.updater.models.infer({"x": X})
        return result.outputs["probabilities"], result.version


@pytest.fixture
def target(tmp_path: Path, signing: SigningKey, server: BlobServer) -> Target:
    return Target(tmp_path / "device", signing.public_pem, server)


def test_a_signed_model_is_downloaded_verified_and_served(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    order = make_order(signing, server, V1, "1.0.0")

    # Execute
    target.updater.apply([order])

    # Assert
    assert target.states(order.execution_id) == [S.DOWNLOADING, S.DOWNLOADED, S.VERIFYING, S.INSTALLING, S.ACTIVE]
    final = target.final(order.execution_id)
    assert (final.installed.name, final.installed.version, final.via_delta) == ("classifier", "1.0.0", False)  # type: ignore[union-attr]
    assert target.updater.installed()["model"].sha256 == hashlib.sha256(V1).hexdigest()
    outputs, version = target.infer()
    assert version == "1.0.0"
    np.testing.assert_allclose(outputs, expected(V1), rtol=1e-6)
    described = target.updater.models.models()[0]
    assert described["inputs"] == [{"name": "x", "shape": ["batch", 128], "dtype": "float32"}]
    assert [o["name"] for o in described["outputs"]] == ["probabilities"]


def test_a_tampered_byte_is_rejected_and_the_old_model_serves_on(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    target.updater.apply([make_order(signing, server, V1, "1.0.0")])
    tampered = bytearray(V2)
    tampered[len(tampered) // 2] ^= 0x01
    order = make_order(signing, server, V2, "1.1.0", served=bytes(tampered))

    # Execute
    target.updater.apply([order])

    # Assert
    final = target.final(order.execution_id)
    assert final.state is S.REJECTED and "SHA-256" in final.detail
    assert target.updater.installed()["model"].version == "1.0.0"
    assert target.infer()[1] == "1.0.0"
    assert not list((target.updater.root / "partial").glob("*.part"))


def test_a_manifest_signed_by_another_key_is_rejected_before_download(target: Target, server: BlobServer, tmp_path: Path) -> None:
    # Prepare
    impostor = SigningKey.load_or_create(tmp_path / "impostor")
    order = make_order(impostor, server, V1, "1.0.0")

    # Execute
    target.updater.apply([order])

    # Assert
    assert target.states(order.execution_id) == [S.REJECTED]
    assert "bad signature" in target.final(order.execution_id).detail
    assert server.requests == []
    assert target.updater.installed() == {}


def test_a_downgrade_is_rejected_unless_the_deployment_allows_it(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    target.updater.apply([make_order(signing, server, V2, "1.1.0")])
    refused, allowed = make_order(signing, server, V1, "1.0.0"), make_order(signing, server, V1, "1.0.0", allow_downgrade=True)

    # Execute
    target.updater.apply([refused])
    target.updater.apply([allowed])

    # Assert
    assert target.states(refused.execution_id) == [S.REJECTED]
    assert "downgrade" in target.final(refused.execution_id).detail
    assert target.final(allowed.execution_id).state is S.ACTIVE
    assert target.infer()[1] == "1.0.0"


def test_the_same_version_and_content_is_active_at_once(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    target.updater.apply([make_order(signing, server, V1, "1.0.0")])
    server.requests.clear()
    again = make_order(signing, server, V1, "1.0.0")

    # Execute
    target.updater.apply([again])

    # Assert
    assert target.states(again.execution_id) == [S.ACTIVE]
    assert server.requests == []


def test_a_delta_is_used_and_the_rebuilt_model_verified(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    target.updater.apply([make_order(signing, server, V1, "1.0.0")])
    server.requests.clear()
    patch = bsdiff4.diff(V1, V2)
    order = make_order(signing, server, V2, "1.1.0", delta=offer_delta(server, V1, patch))

    # Execute
    target.updater.apply([order])

    # Assert
    final = target.final(order.execution_id)
    assert (final.state, final.via_delta) == (S.ACTIVE, True)
    assert server.paths() == [order.delta.path]  # type: ignore[union-attr]
    np.testing.assert_allclose(target.infer()[0], expected(V2), rtol=1e-6)


@pytest.mark.parametrize("corruption", ["patch bytes", "wrong base"])
def test_a_bad_delta_falls_back_to_the_full_download(target: Target, signing: SigningKey, server: BlobServer, corruption: str) -> None:
    # Prepare
    target.updater.apply([make_order(signing, server, V1, "1.0.0")])
    server.requests.clear()
    patch = bsdiff4.diff(V1, V2)
    if corruption == "patch bytes":
        delta = offer_delta(server, V1, patch, served=patch[:-10] + b"\0" * 10)
    else:
        delta = offer_delta(server, V2, patch)  # a base this device does not have
    order = make_order(signing, server, V2, "1.1.0", delta=delta)

    # Execute
    target.updater.apply([order])

    # Assert
    final = target.final(order.execution_id)
    assert (final.state, final.via_delta) == (S.ACTIVE, False)
    assert order.path in server.paths()
    assert target.infer()[1] == "1.1.0"


def test_an_interrupted_download_resumes_with_a_range_request(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    order = make_order(signing, server, V1, "1.0.0")
    server.drop_after[order.path] = len(V1) // 2

    # Execute
    target.updater.apply([order])

    # Assert
    assert target.final(order.execution_id).state is S.ACTIVE
    ranges = [r for p, r in server.requests if p == order.path]
    assert ranges[0] is None
    assert ranges[1] is not None and int(ranges[1].removeprefix("bytes=").rstrip("-")) >= len(V1) // 2 - 65536


def test_a_full_answer_to_a_range_request_restarts_from_zero(tmp_path: Path, server: BlobServer) -> None:
    # Prepare
    server.ignore_range = True
    server.blobs["/blob"] = V1
    downloader = Downloader(server.base_url, tmp_path, attempts=2, max_delay_s=0.01)
    sha = hashlib.sha256(V1).hexdigest()
    downloader.part_path(sha).write_bytes(b"garbage that is not the start of the file")

    # Execute
    path = downloader.fetch("/blob", "download-token-1", sha, len(V1))

    # Assert
    assert path.read_bytes() == V1
    assert server.requests[0][1] == "bytes=41-"


def test_a_redelivered_order_is_not_installed_again_after_a_restart(tmp_path: Path, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    first = Target(tmp_path / "device", signing.public_pem, server)
    order = make_order(signing, server, V1, "1.0.0")
    first.updater.apply([order])
    server.requests.clear()

    # Execute
    restarted = Target(tmp_path / "device", signing.public_pem, server)
    restarted.updater.apply([order])

    # Assert
    assert server.requests == []
    assert [(e.state, e.installed.version) for e in restarted.events] == [(S.ACTIVE, "1.0.0")]  # type: ignore[union-attr]
    assert restarted.infer()[1] == "1.0.0"  # the installed model loads again at start


def test_requests_in_flight_during_a_swap_see_old_or_new_never_an_error(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    target.updater.apply([make_order(signing, server, V1, "1.0.0")])
    outputs = {"1.0.0": expected(V1), "1.1.0": expected(V2)}
    seen: list[str] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def hammer() -> None:
        while not done.is_set():
            try:
                result, version = target.infer()
                np.testing.assert_allclose(result, outputs[version], rtol=1e-6)
                seen.append(version)
            except BaseException as exc:  # noqa: BLE001 - any failure fails the test
                errors.append(exc)
                return

    thread = threading.Thread(target=hammer)
    thread.start()

    # Execute
    order = make_order(signing, server, V2, "1.1.0")
    target.updater.apply([order])
    after = len(seen)
    while len(seen) < after + 20 and thread.is_alive():
        time.sleep(0.001)
    done.set()
    thread.join(10)

    # Assert
    assert errors == []
    assert target.final(order.execution_id).state is S.ACTIVE
    assert seen[0] == "1.0.0" and set(seen[after:]) == {"1.1.0"}


def test_a_model_that_does_not_load_fails_and_the_old_one_serves(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    target.updater.apply([make_order(signing, server, V1, "1.0.0")])
    broken = make_order(signing, server, b"not an onnx model" * 100, "1.2.0")

    # Execute
    target.updater.apply([broken])

    # Assert
    final = target.final(broken.execution_id)
    assert final.state is S.FAILED and "does not load" in final.detail
    assert target.infer()[1] == "1.0.0"
    assert target.updater.installed()["model"].version == "1.0.0"
    assert len(list((target.updater.root / "models" / "classifier").iterdir())) == 1


def test_a_tflite_model_without_the_runtime_fails_clearly(target: Target, signing: SigningKey, server: BlobServer) -> None:
    pytest.importorskip("numpy")
    try:
        import ai_edge_litert  # noqa: F401

        pytest.skip("LiteRT is installed here")
    except ImportError:
        pass
    order = make_order(signing, server, b"TFL3" + b"\0" * 60, "1.0.0", fmt=ArtifactFormat.TFLITE)

    target.updater.apply([order])

    final = target.final(order.execution_id)
    assert final.state is S.FAILED and "tflite runtime not installed" in final.detail


def test_a_rollback_order_reinstalls_the_previous_version(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    v1 = make_order(signing, server, V1, "1.0.0")
    target.updater.apply([v1])
    v2 = make_order(signing, server, V2, "1.1.0")
    target.updater.apply([v2])
    server.requests.clear()
    rollback = make_order(signing, server, V1, "1.0.0", action=OrderAction.ROLLBACK, execution_id=v2.execution_id)

    # Execute
    target.updater.apply([rollback])

    # Assert
    assert target.states(v2.execution_id)[-2:] == [S.ROLLING_BACK, S.ROLLED_BACK]
    assert target.final(v2.execution_id).installed.version == "1.0.0"  # type: ignore[union-attr]
    assert server.requests == []  # the previous version was kept on the device
    np.testing.assert_allclose(target.infer()[0], expected(V1), rtol=1e-6)


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_an_application_is_unpacked_and_its_current_link_switched(target: Target, signing: SigningKey, server: BlobServer) -> None:
    # Prepare
    app = {"kind": ArtifactKind.APPLICATION, "fmt": ArtifactFormat.TAR_GZ, "name": "counter"}
    first = make_order(signing, server, _tar({"app/main.py": b"print(1)\n"}), "1.0.0", **app)  # type: ignore[arg-type]
    second = make_order(signing, server, _tar({"app/main.py": b"print(2)\n"}), "2.0.0", **app)  # type: ignore[arg-type]
    evil = make_order(signing, server, _tar({"../escape.py": b"x"}), "3.0.0", **app)  # type: ignore[arg-type]

    # Execute
    target.updater.apply([first])
    target.updater.apply([second])
    target.updater.apply([evil])

    # Assert
    apps = target.updater.root / "apps" / "counter"
    assert [target.final(o.execution_id).state for o in (first, second, evil)] == [S.ACTIVE, S.ACTIVE, S.FAILED]
    assert (apps / "current" / "app" / "main.py").read_bytes() == b"print(2)\n"
    assert (apps / "1.0.0").is_dir() and not (apps / "3.0.0").exists()
    assert not (target.updater.root / "apps" / "escape.py").exists()
    assert target.updater.installed()["application"].version == "2.0.0"


class FakeSlots:
    """Stands in for FirmwareSlots: records the install, says what boot() would."""

    def __init__(self) -> None:
        self.installed_images: list[tuple[bytes, str]] = []
        self.running = None

    def active(self):  # type: ignore[no-untyped-def]
        return self.running

    def active_image(self) -> None:
        return None

    def install(self, image: Path, signed, execution_id: str, confirm_timeout_s: float) -> None:  # type: ignore[no-untyped-def]
        self.installed_images.append((image.read_bytes(), execution_id))


def test_firmware_is_written_then_rebooted_and_ends_with_the_boot(tmp_path: Path, signing: SigningKey, server: BlobServer) -> None:
    from device.ota.firmware import BootResult
    from interfaces.deployments import InstalledArtifact

    # Prepare
    slots, reboots, events = FakeSlots(), [], []
    image = b"firmware image bytes" * 50
    order = make_order(signing, server, image, "2.0.0", name="sensor-fw", kind=ArtifactKind.FIRMWARE, fmt=ArtifactFormat.FIRMWARE)

    def updater() -> Updater:
        return Updater(tmp_path, signing.public_pem, server.base_url, events.append, slots, lambda: reboots.append(1))  # type: ignore[arg-type]

    # Execute
    updater().apply([order])
    before_reboot = [e.state for e in events]
    events.clear()
    after = updater()
    after.apply([order])  # redelivered before the boot result is known: nothing is written again
    slots.running = InstalledArtifact(name="sensor-fw", version="2.0.0", sha256=order.signed_manifest.manifest.sha256, slot="b")
    after.report_boot(BootResult(slot="b", installed=slots.running, outcome="confirmed", execution_id=order.execution_id, detail="health check passed"))
    after.apply([order])

    # Assert
    assert before_reboot == [S.DOWNLOADING, S.DOWNLOADED, S.VERIFYING, S.INSTALLING]
    assert slots.installed_images == [(image, order.execution_id)] and reboots == [1]
    assert [e.state for e in events] == [S.INSTALLING, S.ACTIVE, S.ACTIVE]
    assert after.installed()["firmware"].slot == "b"


def test_without_a_pinned_key_every_order_is_rejected(tmp_path: Path, signing: SigningKey, server: BlobServer) -> None:
    events: list[ExecutionProgress] = []
    order = make_order(signing, server, V1, "1.0.0")

    Updater(tmp_path, None, server.base_url, events.append).apply([order])

    assert [(e.state, "signing key" in e.detail) for e in events] == [(S.REJECTED, True)]
    assert server.requests == []


def test_a_key_pinned_after_the_updater_started_is_used(tmp_path: Path, signing: SigningKey, server: BlobServer) -> None:
    """An older edge identity pins the hub key later (its artefact cache fetches it): the next order uses it."""
    # Prepare
    from device.ota.verify import load_public_key

    events: list[ExecutionProgress] = []
    pinned: list[object] = []
    updater = Updater(tmp_path, None, server.base_url, events.append, models=ModelHost(tmp_path / "ota" / "models", threads=1))
    updater.signing_key_source = lambda: pinned[0] if pinned else None  # type: ignore[assignment, return-value]
    first, second = make_order(signing, server, V1, "1.0.0"), make_order(signing, server, V2, "1.1.0")

    # Execute
    updater.apply([first])
    pinned.append(load_public_key(signing.public_pem))
    updater.apply([second])

    # Assert
    assert [e.state for e in events if e.execution_id == first.execution_id] == [S.REJECTED]
    assert [e.state for e in events if e.execution_id == second.execution_id][-1] == S.ACTIVE
