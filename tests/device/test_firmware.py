"""Firmware images and A/B slots: the tool (build, sign, inspect), the reader's refusals (unsafe members, a
damaged gzip stream, files that do not match their recorded digests), commit-after-boot, the updater's
REJECTED for a signed but damaged image, and ``kill -9`` of real processes during install and during boot
confirmation."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloud.signing import SigningKey
from device.ota.firmware import FirmwareSlots
from device.ota.firmware_image import ImageError, read_image, unpack_image
from device.ota.updater import Updater
from device.ota.verify import VerificationError, load_public_key, sha256_file, verify_content, verify_manifest
from firmware_images.cli import firmware
from firmware_images.image import build_image, key_id, load_private_key, sign_image
from interfaces.deployments import (
    ArtifactFormat, ArtifactKind, ArtifactManifest, ExecutionProgress, ExecutionState, SignedManifest, manifest_signing_bytes,
)  # fmt: skip
from tests.device.ota_support import blob_server, make_order

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "firmware_images" / "samples"
SAMPLE_KEY = SAMPLES / "sample-signing.key"
SAMPLE_PUB = SAMPLES / "sample-signing.pub"
PYTHON = sys.executable


# ---- helpers ---------------------------------------------------------------------------------------


def sample(version: str) -> tuple[Path, SignedManifest]:
    return SAMPLES / f"sensor-fw-{version}.fw", SignedManifest.model_validate_json((SAMPLES / f"sensor-fw-{version}.manifest.json").read_text())


def build_signed(src: Path, out: Path) -> tuple[Path, SignedManifest]:
    build_image(src, out)
    return out, sign_image(out, load_private_key(SAMPLE_KEY.read_bytes()))


def custom_source(tmp_path: Path, version: str, health: str, timeout_s: float = 10) -> Path:
    src = tmp_path / f"src-{version}"
    (src / "app").mkdir(parents=True)
    header = {"name": "sensor-fw", "version": version, "health": {"argv": ["python3", "health.py"], "timeout_s": timeout_s}}
    (src / "firmware.json").write_text(json.dumps(header))
    (src / "app" / "config.json").write_text(json.dumps({"firmware_version": version}))
    (src / "health.py").write_text(health)
    return src


def sign_sample_key(image: Path) -> SignedManifest:
    """A manifest of ``image``'s bytes signed with the sample key, whatever they hold (as the hub signs an
    upload; ``sign_image`` would refuse to sign a damaged image)."""
    key = load_private_key(SAMPLE_KEY.read_bytes())
    manifest = ArtifactManifest(
        name="sensor-fw", version="1.1.0", kind=ArtifactKind.FIRMWARE, format=ArtifactFormat.FIRMWARE,
        sha256=sha256_file(image), size=image.stat().st_size, created_at=datetime.now(UTC),
    )  # fmt: skip
    signature = base64.b64encode(key.sign(manifest_signing_bytes(manifest))).decode()
    return SignedManifest(manifest=manifest, signature=signature, key_id=key_id(key.public_key()))


def corrupt_gzip(image: Path, out: Path, how: str) -> Path:
    """``image`` with its gzip stream damaged: a byte flipped in the compressed data or in the CRC, or its tail cut off."""
    data = bytearray(image.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01  # inside the compressed data, well away from the gzip header and trailer
    elif how == "crc":
        data[-8] ^= 0x01  # the trailer's CRC-32
    else:
        del data[-64:]  # the trailer and the tar's zero padding: every member is still whole
    out.write_bytes(bytes(data))
    return out


def repack(image: Path, out: Path, files: dict[str, bytes | None]) -> Path:
    """``image`` packed again, with real tar and gzip: each name in ``files`` gets that content (None: left
    out; a name the image lacks: added). The stream is sound; only what it holds differs."""
    raw = io.BytesIO()
    with tarfile.open(image) as source, tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as target:
        for info in source.getmembers():
            extracted = source.extractfile(info) if info.isreg() else None
            data = extracted.read() if extracted is not None else None
            if info.name in files:
                data = files[info.name]
                if data is None:
                    continue
                info.size = len(data)
            target.addfile(info, io.BytesIO(data) if data is not None else None)
        for name in files.keys() - set(source.getnames()):
            added = files[name]
            assert added is not None
            info = tarfile.TarInfo(name)
            info.size = len(added)
            target.addfile(info, io.BytesIO(added))
    out.write_bytes(gzip.compress(raw.getvalue(), mtime=0))
    return out


def firmware_json(image: Path) -> dict:  # type: ignore[type-arg]
    with tarfile.open(image) as tar:
        extracted = tar.extractfile("firmware.json")
        assert extracted is not None
        return json.loads(extracted.read())  # type: ignore[no-any-return]


def inspect_image(image: Path, signed: SignedManifest | None, tmp_path: Path) -> tuple[int, str]:
    """``aisynergy firmware inspect`` (with the signed manifest and the sample key, if given): exit code, output."""
    args = ["inspect", str(image)]
    if signed is not None:
        manifest = tmp_path / f"{image.name}.manifest.json"
        manifest.write_text(signed.model_dump_json())
        args += ["--manifest", str(manifest), "--public-key", str(SAMPLE_PUB)]
    result = CliRunner().invoke(firmware, args)
    return result.exit_code, result.output


HANGING_HEALTH = """
import os, time
from pathlib import Path
started = os.environ.get("TEST_HEALTH_STARTED")
if started:
    Path(started).write_text(str(os.getpid()))
time.sleep(120)
"""


def provisioned(tmp_path: Path) -> FirmwareSlots:
    slots = FirmwareSlots(tmp_path / "data" / "firmware")
    slots.provision(*sample("1.0.0"))
    return slots


def assert_settled(slots: FirmwareSlots, version: str, slot: str) -> None:
    """A defined state: one confirmed slot runs, nothing pending, no leftovers of an install or a removal."""
    state = json.loads((slots.root / "boot.json").read_text())
    assert state["pending"] is None
    assert state["active"] == slot
    active = slots.active()
    assert active is not None and (active.version, active.slot) == (version, slot)
    assert not (slots.root / "installing.json").exists()
    assert not [p.name for p in slots.root.iterdir() if p.name.startswith(".")]
    content = slots.slot_dir()
    assert content == slots.root / slot / "content"
    assert json.loads((content / "app" / "config.json").read_text())["firmware_version"] == version
    image = slots.active_image()
    assert image is not None and sha256_file(image) == active.sha256


def read_line(proc: subprocess.Popen[str], expected: str, timeout_s: float = 30) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"the child exited ({proc.wait()}) before printing {expected!r}")
            if line.strip() == expected:
                return
    raise AssertionError(f"no {expected!r} from the child within {timeout_s} s")


def wait_for_file(path: Path, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout_s} s")


def kill9(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the child runs in its own session: all of it dies, as in a power cut
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


# ---- the tool --------------------------------------------------------------------------------------


def test_build_is_deterministic_and_matches_the_committed_sample(tmp_path: Path) -> None:
    first, second, src = tmp_path / "one.fw", tmp_path / "two.fw", tmp_path / "src"
    shutil.copytree(SAMPLES / "sensor-fw-1.0.0", src)
    build_image(src, first, compress_level=0)
    os.utime(src / "health.py", (1, 1))  # neither mtimes nor junk files matter
    (src / "app" / "__pycache__").mkdir()
    (src / "app" / "__pycache__" / "sensor.cpython-311.pyc").write_bytes(b"junk")
    build_image(src, second, compress_level=0)
    assert first.read_bytes() == second.read_bytes()
    assert gzip.decompress(first.read_bytes()) == gzip.decompress((SAMPLES / "sensor-fw-1.0.0.fw").read_bytes())
    names = [m.name for m in read_image(first).members]
    assert names == ["firmware.json", "app", "app/config.json", "app/sensor.py", "health.py"]
    with tarfile.open(first) as tar:
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in tar.getmembers()} == {(0, 0, 0, "", "")}


def test_committed_samples_are_signed_by_the_sample_key() -> None:
    key = load_public_key(SAMPLE_PUB.read_bytes())
    for version in ("1.0.0", "1.1.0"):
        image, signed = sample(version)
        verify_manifest(key, signed)
        assert (signed.manifest.kind, signed.manifest.format, signed.manifest.version) == ("firmware", "firmware", version)
        assert (signed.manifest.sha256, signed.manifest.size) == (sha256_file(image), image.stat().st_size)
    assert b"SAMPLE KEY FOR TESTS" in SAMPLE_KEY.read_bytes()


def test_keygen_build_sign_inspect_round_trip(tmp_path: Path) -> None:
    runner = CliRunner()
    key, image, manifest = tmp_path / "vendor.key", tmp_path / "fw.fw", tmp_path / "fw.manifest.json"
    assert runner.invoke(firmware, ["keygen", str(key)]).exit_code == 0
    assert key.stat().st_mode & 0o777 == 0o600
    result = runner.invoke(firmware, ["build", str(SAMPLES / "sensor-fw-1.1.0"), "-o", str(image), "--version", "1.1.1"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(firmware, ["sign", str(image), "--key", str(key)])
    assert result.exit_code == 0, result.output
    signed = SignedManifest.model_validate_json(manifest.read_text())
    assert (signed.manifest.name, signed.manifest.version, signed.manifest.kind) == ("sensor-fw", "1.1.1", "firmware")

    result = runner.invoke(firmware, ["inspect", str(image), "--manifest", str(manifest), "--public-key", str(tmp_path / "vendor.pub"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["firmware"]["version"] == "1.1.1" and report["manifest"]["verified"] is True
    assert report["sha256"] == signed.manifest.sha256 and report["size"] == image.stat().st_size
    assert "app/config.json" in [m["name"] for m in report["members"]]
    assert report["digests"] == {"recorded": True, "verified": 3}
    assert all(len(m["sha256"]) == 64 for m in report["members"] if m["type"] == "file")
    assert runner.invoke(firmware, ["keygen", str(key)]).exit_code == 1  # never overwrites a key


def test_inspect_detects_a_tampered_image_and_a_foreign_key(tmp_path: Path) -> None:
    image, manifest = tmp_path / "fw.fw", SAMPLES / "sensor-fw-1.1.0.manifest.json"
    data = bytearray((SAMPLES / "sensor-fw-1.1.0.fw").read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the stored (uncompressed) payload: still a readable image
    image.write_bytes(bytes(data))
    cmd = [PYTHON, "-m", "firmware_images.cli", "inspect", str(image), "--manifest", str(manifest), "--public-key", str(SAMPLE_PUB)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "does not match the manifest" in proc.stderr and "SHA-256" in proc.stderr

    runner = CliRunner()
    assert runner.invoke(firmware, ["keygen", str(tmp_path / "other.key")]).exit_code == 0
    good = str(SAMPLES / "sensor-fw-1.1.0.fw")
    result = runner.invoke(firmware, ["inspect", good, "--manifest", str(manifest), "--public-key", str(tmp_path / "other.pub")])
    assert result.exit_code == 1 and "bad signature" in result.output
    result = runner.invoke(firmware, ["inspect", good, "--manifest", str(SAMPLES / "sensor-fw-1.0.0.manifest.json"), "--public-key", str(SAMPLE_PUB)])
    assert result.exit_code == 1
    assert runner.invoke(firmware, ["inspect", good, "--manifest", str(manifest), "--public-key", str(SAMPLE_PUB)]).exit_code == 0


def test_build_records_the_digest_and_size_of_every_file(tmp_path: Path) -> None:
    image = tmp_path / "fw.fw"
    src = SAMPLES / "sensor-fw-1.1.0"

    info = build_image(src, image)

    expected = {rel: {"sha256": hashlib.sha256((src / rel).read_bytes()).hexdigest(), "size": (src / rel).stat().st_size}
                for rel in ("app/config.json", "app/sensor.py", "health.py")}  # fmt: skip
    assert firmware_json(image)["files"] == expected
    assert info.files is not None and {k: v.model_dump() for k, v in info.files.items()} == expected
    contents = read_image(image)
    assert contents.digests_recorded
    assert {m.name: m.sha256 for m in contents.members if m.type == "file" and m.name != "firmware.json"} == {k: v["sha256"] for k, v in expected.items()}
    for version in ("1.0.0", "1.1.0"):  # the committed samples carry them too
        assert firmware_json(sample(version)[0])["files"].keys() == expected.keys()

    unpacked = tmp_path / "unpacked"  # an unpacked image: its firmware.json lists files, which a build replaces
    unpack_image(image, unpacked)
    (unpacked / "app" / "config.json").write_text('{"firmware_version": "1.1.1"}')
    rebuilt = tmp_path / "rebuilt.fw"
    build_image(unpacked, rebuilt, version="1.1.1")
    assert firmware_json(rebuilt)["files"]["app/config.json"]["size"] == len('{"firmware_version": "1.1.1"}')
    assert read_image(rebuilt).info.version == "1.1.1"


@pytest.mark.parametrize("level", [0, 9])
@pytest.mark.parametrize("how", ["flip", "crc", "truncate"])
def test_a_signed_image_with_a_damaged_gzip_stream_is_rejected_and_the_old_slot_runs(tmp_path: Path, level: int, how: str) -> None:
    # Prepare: slot a runs 1.0.0; a 1.1.0 image damaged after it was built, then signed (its outer bytes check out)
    slots = provisioned(tmp_path)
    good = tmp_path / "good.fw"
    build_image(SAMPLES / "sensor-fw-1.1.0", good, compress_level=level)
    image = corrupt_gzip(good, tmp_path / "damaged.fw", how)
    signed = sign_sample_key(image)
    verify_manifest(load_public_key(SAMPLE_PUB.read_bytes()), signed)
    verify_content(signed, image)

    # Execute + Assert: the install refuses it before the slot is written
    with pytest.raises(ImageError, match="damaged"):
        slots.install(image, signed, "ex-damaged", 60)
    assert not (slots.root / "b").exists()
    assert slots.boot().outcome == "normal"
    assert_settled(slots, "1.0.0", "a")

    # Execute + Assert: so does inspect, with and without the (valid) manifest
    for manifest in (signed, None):
        code, output = inspect_image(image, manifest, tmp_path)
        assert code == 1, output
        assert "invalid image: the image is damaged" in output
    with pytest.raises(ImageError, match="damaged"):
        sign_image(image, load_private_key(SAMPLE_KEY.read_bytes()))  # the tool does not sign it either


def test_a_file_that_does_not_match_its_recorded_digest_is_rejected(tmp_path: Path) -> None:
    # Prepare: images whose gzip stream is sound but whose files are not what firmware.json records
    slots = provisioned(tmp_path)
    good, _ = sample("1.1.0")
    config = (SAMPLES / "sensor-fw-1.1.0" / "app" / "config.json").read_bytes()
    cases = {
        "same size, other bytes": ({"app/config.json": config.replace(b"1.1.0", b"6.6.6")}, "does not match firmware.json: SHA-256"),
        "other size": ({"app/config.json": config + b" "}, f"has {len(config) + 1} bytes; firmware.json records {len(config)}"),
        "a file left out": ({"health.py": None}, "lists 'health.py', which is not a regular file"),
        "a file added": ({"app/extra.py": b"print('not built')"}, "'app/extra.py' is not listed"),
    }
    for i, (files, message) in enumerate(cases.values()):
        image = repack(good, tmp_path / f"mismatch-{i}.fw", files)
        signed = sign_sample_key(image)

        # Execute + Assert
        with pytest.raises(ImageError, match=message):
            slots.install(image, signed, f"ex-mismatch-{i}", 60)
        assert not (slots.root / "b").exists()
        code, output = inspect_image(image, signed, tmp_path)
        assert code == 1 and message in output, output
    assert slots.boot().outcome == "normal"
    assert_settled(slots, "1.0.0", "a")


def test_an_image_built_before_digests_is_accepted_on_its_archive_alone(tmp_path: Path) -> None:
    """Images built before firmware.json recorded ``files`` still install (a rollback to them must work),
    checked by the gzip stream's CRC; the report says that no digests were checked."""
    # Prepare
    slots = provisioned(tmp_path)
    header = firmware_json(sample("1.1.0")[0])
    del header["files"]
    legacy = repack(sample("1.1.0")[0], tmp_path / "legacy.fw", {"firmware.json": json.dumps(header).encode()})

    # Execute + Assert
    assert not read_image(legacy).digests_recorded
    code, output = inspect_image(legacy, sign_sample_key(legacy), tmp_path)
    assert code == 0 and "no digests recorded" in output and "manifest: verified" in output, output
    damaged = corrupt_gzip(legacy, tmp_path / "legacy-damaged.fw", "flip")
    with pytest.raises(ImageError, match="CRC check failed"):
        slots.install(damaged, sign_sample_key(damaged), "ex-legacy-damaged", 60)
    slots.install(legacy, sign_sample_key(legacy), "ex-legacy", 60)
    assert slots.boot().outcome == "confirmed"
    assert_settled(slots, "1.1.0", "b")


def test_a_damaged_tar_header_in_a_sound_gzip_stream_is_not_taken_for_the_end_of_the_archive(tmp_path: Path) -> None:
    image, _ = sample("1.1.0")
    with tarfile.open(image) as tar:
        offset = tar.getmember("app/sensor.py").offset
    raw = bytearray(gzip.decompress(image.read_bytes()))
    raw[offset] ^= 0x01  # the header's checksum no longer matches: tarfile alone would stop here, quietly
    broken = tmp_path / "broken-header.fw"
    broken.write_bytes(gzip.compress(bytes(raw), mtime=0))

    with pytest.raises(ImageError, match="data after the end of its archive"):
        read_image(broken)


def _tar(tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], with_header: bool = True) -> Path:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        if with_header:
            header = json.dumps({"name": "x", "version": "1.0.0", "health": {"argv": ["true"]}}).encode()
            info = tarfile.TarInfo("firmware.json")
            info.size = len(header)
            tar.addfile(info, io.BytesIO(header))
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path = tmp_path / "evil.fw"
    path.write_bytes(gzip.compress(raw.getvalue()))
    return path


def _member(name: str, type: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = type, link
    return info


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([(_member("/etc/passwd"), b"x")], "absolute"),
        ([(_member("app/../../escape"), b"x")], ".."),
        ([(_member("app/link", tarfile.SYMTYPE, "../../etc"), None)], "outside"),
        ([(_member("app/link", tarfile.SYMTYPE, "/etc"), None)], "outside"),
        ([(_member("d", tarfile.SYMTYPE, "."), None), (_member("d/x"), b"x")], "under a symbolic link"),
        ([(_member("hard", tarfile.LNKTYPE, "../outside"), None)], ".."),
        ([(_member("hard", tarfile.LNKTYPE, "missing"), None)], "not an earlier regular file"),
        ([(_member("dev", tarfile.CHRTYPE), None)], "device"),
        ([(_member("fifo", tarfile.FIFOTYPE), None)], "device"),
        ([(_member("a"), b"1"), (_member("./a"), b"2")], "twice"),
    ],
)
def test_reader_refuses_unsafe_members(tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], message: str) -> None:
    image = _tar(tmp_path, members)
    with pytest.raises(ImageError, match=message.replace(".", r"\.")):
        read_image(image)
    with pytest.raises(ImageError):
        unpack_image(image, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_reader_refuses_missing_or_invalid_firmware_json_and_oversized_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImageError, match="no firmware.json"):
        read_image(_tar(tmp_path, [(_member("a"), b"1")], with_header=False))
    bad = _member("firmware.json")
    with pytest.raises(ImageError, match="not valid"):
        read_image(_tar(tmp_path, [(bad, b'{"name": "x", "version": "one"}')], with_header=False))
    coerced = b'{"name": "x", "version": "1.0.0", "health": {"argv": ["true"]}, "files": {"a": {"sha256": "%s", "size": "1"}}}' % (b"0" * 64)
    with pytest.raises(ImageError, match="not valid"):  # strict: a size given as a string is not taken for a number
        read_image(_tar(tmp_path, [(_member("firmware.json"), coerced), (_member("a"), b"1")], with_header=False))
    (tmp_path / "junk.fw").write_bytes(b"not a tar")
    with pytest.raises(ImageError, match="not a gzip tar"):
        read_image(tmp_path / "junk.fw")
    from device.ota import firmware_image

    monkeypatch.setattr(firmware_image, "MAX_UNPACKED_BYTES", 100)
    with pytest.raises(ImageError, match="unpacks to more than"):
        read_image(_tar(tmp_path, [(_member("big"), b"x" * 200)]))
    monkeypatch.setattr(firmware_image, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(ImageError, match="at most 100"):
        read_image(SAMPLES / "sensor-fw-1.0.0.fw")


# ---- slots: commit after boot ------------------------------------------------------------------------


def test_no_firmware_boots_none(tmp_path: Path) -> None:
    slots = FirmwareSlots(tmp_path / "firmware")
    result = slots.boot()
    assert (result.outcome, result.slot, result.installed) == ("none", None, None)
    assert slots.active() is None and slots.slot_dir() is None and slots.active_image() is None
    assert not (tmp_path / "firmware").exists()


def test_install_then_boot_confirms_the_new_slot(tmp_path: Path) -> None:
    slots = provisioned(tmp_path)
    assert slots.boot().outcome == "normal"
    slots.install(*sample("1.1.0"), execution_id="ex-1", confirm_timeout_s=60)
    assert slots.active().version == "1.0.0"  # type: ignore[union-attr]  # not ACTIVE before the boot
    assert (slots.root / "b" / "content" / "health.py").exists()

    result = slots.boot()

    assert (result.outcome, result.slot, result.execution_id) == ("confirmed", "b", "ex-1")
    assert result.installed is not None and result.installed.version == "1.1.0"
    assert_settled(slots, "1.1.0", "b")
    again = slots.boot()
    assert (again.outcome, again.slot, again.execution_id) == ("normal", "b", None)
    slots.install(*sample("1.0.0"), execution_id="ex-2", confirm_timeout_s=60)  # the next install goes to slot a
    assert slots.boot().outcome == "confirmed"
    assert_settled(slots, "1.0.0", "a")


def test_a_failing_health_check_rolls_back(tmp_path: Path) -> None:
    slots = provisioned(tmp_path)
    image, signed = build_signed(SAMPLES / "sensor-fw-1.2.0-bad", tmp_path / "bad.fw")
    slots.install(image, signed, "ex-bad", 60)

    result = slots.boot()

    assert (result.outcome, result.slot, result.execution_id) == ("rolled_back", "a", "ex-bad")
    assert "self-test failed" in result.detail and "exit 1" in result.detail
    assert result.installed is not None and result.installed.version == "1.0.0"
    assert_settled(slots, "1.0.0", "a")
    assert not (slots.root / "b").exists()


def test_a_health_check_that_hangs_past_the_deadline_rolls_back(tmp_path: Path) -> None:
    slots = provisioned(tmp_path)
    image, signed = build_signed(custom_source(tmp_path, "1.3.0", HANGING_HEALTH, timeout_s=60), tmp_path / "hang.fw")
    slots.install(image, signed, "ex-hang", confirm_timeout_s=1.5)

    started = time.monotonic()
    result = slots.boot()

    assert time.monotonic() - started < 10
    assert (result.outcome, result.execution_id) == ("rolled_back", "ex-hang")
    assert "timed out" in result.detail
    assert_settled(slots, "1.0.0", "a")


def test_install_refuses_an_image_that_is_not_the_signed_one(tmp_path: Path) -> None:
    slots = provisioned(tmp_path)
    image, _ = sample("1.1.0")
    _, other = sample("1.0.0")
    with pytest.raises(VerificationError):
        slots.install(image, other, "ex-x", 60)
    assert slots.boot().outcome == "normal"
    assert_settled(slots, "1.0.0", "a")
    assert not (slots.root / "b").exists()


# ---- the updater: REJECTED before the slot is written -------------------------------------------------


def test_the_updater_rejects_damaged_signed_images_and_installs_a_good_one(tmp_path: Path) -> None:
    # Prepare: a device on 1.0.0 (slot a); hub-signed orders for a damaged image, a mismatching one, a good one
    S = ExecutionState
    slots = provisioned(tmp_path)
    signing = SigningKey.load_or_create(tmp_path / "hub-pki")
    events: list[ExecutionProgress] = []
    reboots: list[int] = []
    good, _ = sample("1.1.0")
    damaged = corrupt_gzip(good, tmp_path / "damaged.fw", "truncate").read_bytes()
    config = (SAMPLES / "sensor-fw-1.1.0" / "app" / "config.json").read_bytes()
    mismatch = repack(good, tmp_path / "mismatch.fw", {"app/config.json": config.replace(b"1.1.0", b"6.6.6")}).read_bytes()
    firmware_kind = {"name": "sensor-fw", "kind": ArtifactKind.FIRMWARE, "fmt": ArtifactFormat.FIRMWARE}
    with blob_server() as server:
        orders = [make_order(signing, server, data, "1.1.0", **firmware_kind) for data in (damaged, mismatch, good.read_bytes())]  # type: ignore[arg-type]
        updater = Updater(tmp_path / "data", signing.public_pem, server.base_url, events.append, slots, lambda: reboots.append(1))

        # Execute
        updater.apply(orders[:2])
        refused = [[(e.state, e.detail) for e in events if e.execution_id == o.execution_id] for o in orders[:2]]
        running = (slots.active().version, (slots.root / "b").exists(), slots.boot().outcome)  # type: ignore[union-attr]
        updater.apply(orders[2:])
        result = slots.boot()  # the agent's next start, after the reboot
        updater.report_boot(result)

    # Assert: both REJECTED, with the reason, after the outer checks passed and before the slot was written
    for states, reason in zip(refused, ("damaged", "does not match firmware.json"), strict=True):
        assert [state for state, _ in states] == [S.DOWNLOADING, S.DOWNLOADED, S.VERIFYING, S.INSTALLING, S.REJECTED]
        assert "firmware image refused" in states[-1][1] and reason in states[-1][1], states[-1][1]
    assert running == ("1.0.0", False, "normal")  # the old slot ran on; nothing was written to the other
    assert reboots == [1]  # only for the good image
    assert (result.outcome, result.execution_id) == ("confirmed", orders[2].execution_id)
    assert [e.state for e in events if e.execution_id == orders[2].execution_id][-1] is S.ACTIVE
    assert_settled(slots, "1.1.0", "b")


# ---- kill -9 -------------------------------------------------------------------------------------------

INSTALL_CHILD = """
import os, sys, time
from pathlib import Path
import device.ota.firmware as firmware
import device.ota.firmware_image as firmware_image
from interfaces.deployments import SignedManifest

root, image, manifest, execution_id, where = sys.argv[1:]

def pause():
    print("PAUSED", flush=True)
    time.sleep(120)

if where == "unpack":  # halfway through writing a file of the new slot
    def copy(source, out):
        out.write(source.read(64)); out.flush(); os.fsync(out.fileno())
        pause()
    firmware_image._copy_stream = copy
else:
    real_save = firmware.FirmwareSlots._save
    def save(self, state):
        if where == "after_commit":
            real_save(self, state)
        pause()
    firmware.FirmwareSlots._save = save

firmware.FirmwareSlots(Path(root)).install(Path(image), SignedManifest.model_validate_json(Path(manifest).read_text()), execution_id, 60)
print("DONE", flush=True)
"""


@pytest.mark.parametrize(
    ("where", "outcome"),
    [
        ("unpack", "rolled_back"),  # the slot half written
        ("before_commit", "rolled_back"),  # the slot complete, boot.json not yet pointing at it
        ("after_commit", "confirmed"),  # boot.json written; killed before the marker was removed
    ],
)
def test_kill_9_during_install(tmp_path: Path, where: str, outcome: str) -> None:
    slots = provisioned(tmp_path)
    image, _ = sample("1.1.0")
    proc = subprocess.Popen(
        [PYTHON, "-c", INSTALL_CHILD, str(slots.root), str(image), str(SAMPLES / "sensor-fw-1.1.0.manifest.json"), "ex-kill", where],
        cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        read_line(proc, "PAUSED")
        assert (slots.root / "installing.json").exists()
        kill9(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert slots.active().version == "1.0.0"  # type: ignore[union-attr]  # still the old slot before any boot
    leftovers = [p.name for p in slots.root.iterdir()]
    if where == "unpack":
        assert [n for n in leftovers if n.startswith(".tmp-b-")] and "b" not in leftovers  # killed mid-write, in a temporary dir
    else:
        assert (slots.root / "b" / "slot.json").exists()  # the slot was complete
    assert (json.loads((slots.root / "boot.json").read_text())["pending"] is not None) == (where == "after_commit")

    result = FirmwareSlots(slots.root).boot()  # the agent's next start

    assert (result.outcome, result.execution_id) == (outcome, "ex-kill")
    if outcome == "rolled_back":
        assert "interrupted" in result.detail
        assert_settled(slots, "1.0.0", "a")
        assert not (slots.root / "b").exists()  # no half-written slot left
    else:
        assert_settled(slots, "1.1.0", "b")
    assert FirmwareSlots(slots.root).boot().outcome == "normal"


BOOT_CHILD = """
import sys
from pathlib import Path
from device.ota.firmware import FirmwareSlots
result = FirmwareSlots(Path(sys.argv[1])).boot()
print("RETURNED", result.outcome, flush=True)
"""


def test_kill_9_during_boot_confirmation_rolls_back_on_the_next_boot(tmp_path: Path) -> None:
    slots = provisioned(tmp_path)
    image, signed = build_signed(custom_source(tmp_path, "1.3.0", HANGING_HEALTH, timeout_s=60), tmp_path / "hang.fw")
    slots.install(image, signed, "ex-boot", confirm_timeout_s=600)
    started = tmp_path / "health-started"
    env = {**os.environ, "TEST_HEALTH_STARTED": str(started)}
    proc = subprocess.Popen([PYTHON, "-c", BOOT_CHILD, str(slots.root)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    health_pid = None
    try:
        health_pid = int(wait_for_file(started))  # the new slot booted; its health check is running
        assert json.loads((slots.root / "boot.json").read_text())["pending"]["boot_count"] == 1
        kill9(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if health_pid is not None:
            os.kill(health_pid, signal.SIGKILL)  # the health check runs in a session of its own
    assert slots.active().version == "1.0.0"  # type: ignore[union-attr]

    result = FirmwareSlots(slots.root).boot()

    assert (result.outcome, result.slot, result.execution_id) == ("rolled_back", "a", "ex-boot")
    assert "did not confirm" in result.detail
    assert_settled(slots, "1.0.0", "a")
    assert not (slots.root / "b").exists()


# ---- the device CLI ------------------------------------------------------------------------------------


def test_device_run_provisions_the_factory_image_and_boots_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    image, _ = sample("1.0.0")
    cmd = [
        PYTHON, "-m", "device.cli", "run", "--device-id", "dv-fw-1", "--data-dir", str(data),
        "--firmware", str(image), "--firmware-manifest", str(SAMPLES / "sensor-fw-1.0.0.manifest.json"), "--firmware-public-key", str(SAMPLE_PUB),
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr  # no enrolment URL for a first start: usage, after the firmware booted
    assert "firmware sensor-fw 1.0.0" in proc.stderr
    assert_settled(FirmwareSlots(data / "firmware"), "1.0.0", "a")

    wrong_key = tmp_path / "other.pub"
    assert CliRunner().invoke(firmware, ["keygen", str(tmp_path / "other.key")]).exit_code == 0
    cmd[cmd.index(str(SAMPLE_PUB))] = str(wrong_key)
    cmd[cmd.index(str(data))] = str(tmp_path / "data2")
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 6 and "bad signature" in proc.stderr
    assert not (tmp_path / "data2" / "firmware" / "a").exists()


def test_the_firmware_command_is_registered_for_the_aisynergy_root() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["aisynergy.commands"]["firmware"] == "firmware_images.cli:firmware"


REEXEC_CHILD = """
import os, sys
from device.cli import _reexecute
print("start", os.getpid(), sys.argv[1:], flush=True)
if os.environ.get("TEST_REEXECUTED") != "1":
    os.environ["TEST_REEXECUTED"] = "1"
    _reexecute()
"""


def test_the_reboot_hook_re_executes_the_same_command_in_the_same_process() -> None:
    proc = subprocess.run([PYTHON, "-c", REEXEC_CHILD, "run", "--x"], check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1]  # same pid, same arguments: the process image was replaced
    assert lines[0].endswith("['run', '--x']")
