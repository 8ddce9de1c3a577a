"""Archives a target unpacks: firmware links are followed through the image's other links (nothing may point
outside the slot, in whatever order the links come), and application archives have a member count and an
unpacked size limit (refused with a clear error, nothing half-unpacked left, the current version stays)."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from device.ota.apps import AppInstallError, current_version, install_app
from device.ota.firmware_image import ImageError, read_image, unpack_image
from interfaces.deployments import ArtifactFormat
from tests.device.test_firmware import _member, _tar

SYM, DIR = tarfile.SYMTYPE, tarfile.DIRTYPE


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([(_member("sub", DIR), None), (_member("sub/l", SYM, ".."), None), (_member("esc", SYM, "sub/l/../.."), None)], "outside"),
        ([(_member("esc", SYM, "sub/l/../.."), None), (_member("sub", DIR), None), (_member("sub/l", SYM, ".."), None)], "outside"),
        ([(_member("a", SYM, "b/x"), None), (_member("b", SYM, "a"), None)], "loop"),
        ([(_member("d/x"), b"x"), (_member("d", SYM, "."), None)], "under a symbolic link"),
    ],
)
def test_firmware_links_are_resolved_through_the_image_s_links(tmp_path: Path, members: list, message: str) -> None:  # type: ignore[type-arg]
    # Prepare
    image = _tar(tmp_path, members)

    # Execute / Assert
    with pytest.raises(ImageError, match=message):
        read_image(image)
    with pytest.raises(ImageError):
        unpack_image(image, tmp_path / "slot")
    assert not (tmp_path / "slot").exists()


def test_firmware_links_that_stay_inside_are_unpacked(tmp_path: Path) -> None:
    # Prepare: app/cur -> ../lib/v1 through lib -> store (a link to a link, both inside)
    members = [
        (_member("store", DIR), None), (_member("store/v1", DIR), None), (_member("store/v1/m.py"), b"print(1)\n"),
        (_member("lib", SYM, "store"), None), (_member("app", DIR), None), (_member("app/cur", SYM, "../lib/v1"), None),
    ]  # fmt: skip
    image = _tar(tmp_path, members)

    # Execute
    read_image(image)
    unpack_image(image, tmp_path / "slot")

    # Assert
    assert (tmp_path / "slot" / "app" / "cur" / "m.py").read_bytes() == b"print(1)\n"
    assert (tmp_path / "slot" / "app" / "cur").resolve().is_relative_to((tmp_path / "slot").resolve())


def _tar_gz(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


@pytest.mark.parametrize(("fmt", "make"), [(ArtifactFormat.TAR_GZ, _tar_gz), (ArtifactFormat.ZIP, _zip)])
def test_an_application_archive_over_the_limits_is_refused_and_leaves_nothing(tmp_path: Path, fmt: ArtifactFormat, make) -> None:  # type: ignore[no-untyped-def]
    # Prepare: 1.0.0 runs; 2.0.0 is a compression bomb in small (8 MiB of zeros compress to kilobytes), 2.0.1 has many files
    root = tmp_path / "apps"
    install_app(root, "svc", "1.0.0", fmt, make(tmp_path / f"v1.{fmt.value}", {"main.py": b"print(1)\n"}))
    bomb = make(tmp_path / f"bomb.{fmt.value}", {"main.py": b"print(2)\n", "zeros.bin": bytes(8 * 1024 * 1024)})
    many = make(tmp_path / f"many.{fmt.value}", {f"f{i}.txt": b"x" for i in range(50)})
    assert bomb.stat().st_size < 1024 * 1024

    # Execute
    with pytest.raises(AppInstallError, match="unpacks to more than 1048576 bytes"):
        install_app(root, "svc", "2.0.0", fmt, bomb, max_bytes=1024 * 1024)
    with pytest.raises(AppInstallError, match="more than 20 members"):
        install_app(root, "svc", "2.0.1", fmt, many, max_members=20)
    still = (current_version(root, "svc"), sorted(p.name for p in (root / "svc").iterdir()))
    within = install_app(root, "svc", "2.0.2", fmt, many, max_members=50, max_bytes=50)

    # Assert: nothing of the refused versions on disk, 1.0.0 ran meanwhile; the limits are inclusive
    assert still == ("1.0.0", ["1.0.0", "current"])
    assert sorted(p.name for p in (root / "svc").iterdir()) == ["1.0.0", "2.0.2", "current"]
    assert len(list(within.iterdir())) == 50
    assert current_version(root, "svc") == "2.0.2"
