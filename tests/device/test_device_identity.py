"""The device identity kept in the data directory: the identity contract for the device tier, and the device's own."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from device.agent import Device
from device.cli import EXIT_STORED_STATE, device
from device.identity import IdentityStore
from tests.device.conftest import NODE_ID
from tests.identity_contract import IdentityContract

REPO = Path(__file__).resolve().parents[2]


class TestDeviceIdentity(IdentityContract):
    store = IdentityStore
    owner, other = "dv-0001", "dv-0002"
    ids: ClassVar[dict[str, str]] = {"device_id": "dv-0001", "node_id": NODE_ID}
    url_field = "enrol_url"


def test_cli_exits_4_on_identity_mismatch(tmp_path: Path, test_ca) -> None:  # type: ignore[no-untyped-def]
    store = IdentityStore(tmp_path)
    store.save(test_ca.issue(store.make_csr("dv-0001"), "dv-0001"), "https://edge")

    env = {"AISYNERGY_DEVICE_ID": "dv-0002", "AISYNERGY_DATA_DIR": str(tmp_path)}

    result = CliRunner().invoke(device, ["run"], env=env)

    assert result.exit_code == EXIT_STORED_STATE


def test_the_agent_narrows_a_data_directory_left_open(tmp_path: Path, test_ca) -> None:  # type: ignore[no-untyped-def]
    # Prepare: an earlier version's data directory and key, readable by every user
    store = IdentityStore(tmp_path / "data")
    store.save(test_ca.issue(store.make_csr("dv-0001"), "dv-0001"), "https://edge")
    store.data_dir.chmod(0o755)
    store.key_path.chmod(0o644)

    # Execute
    enrolled_now = Device("dv-0001", store.data_dir).enrol()

    # Assert
    assert enrolled_now is False
    assert stat.S_IMODE(store.data_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(store.key_path.stat().st_mode) == 0o600


def test_cli_first_start_without_token_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        device, ["run", "--enrol-url", "http://127.0.0.1:9", "--device-id", "dv-0001", "--data-dir", str(tmp_path)]
    )

    assert result.exit_code == 2
    assert "bootstrap" in result.output


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("", [], "holds no token"),
        ("two words\n", [], "holds no token"),
        ("bst_" + "a" * 40 + "\n", ["--bootstrap-token", "bst_" + "b" * 40], "exclude each other"),
        ("bst_" + "a" * 40 + "\n", ["--ca-sha256", "sha256:12ab"], "not a CA fingerprint"),
    ],
)
def test_cli_refuses_a_bad_token_file_or_pin_before_it_enrols(tmp_path: Path, content: str, extra: list[str], message: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(content)
    args = ["run", "--enrol-url", "https://127.0.0.1:9", "--device-id", "dv-0001", "--data-dir", str(tmp_path / "d"),
            "--bootstrap-token-file", str(token_file), *extra]  # fmt: skip

    result = CliRunner().invoke(device, args)

    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "d" / "enrolment.json").exists()


def test_cli_refuses_a_device_id_that_is_not_a_topic_level(tmp_path: Path) -> None:
    result = CliRunner().invoke(device, ["run", "--device-id", "dv/+", "--data-dir", str(tmp_path)])

    assert result.exit_code == 2
    assert "device id" in result.output


def test_a_restart_loads_neither_cryptography_nor_httpx(tmp_path: Path, test_ca) -> None:  # type: ignore[no-untyped-def]
    store = IdentityStore(tmp_path)
    store.save(test_ca.issue(store.make_csr("dv-0001"), "dv-0001"), "https://edge")
    script = (
        "import sys; from device.agent import Device; from device.identity import IdentityStore; "
        f"s = IdentityStore({str(tmp_path)!r}); s.check_owner('dv-0001'); s.check_complete(); s.load_enrolment(); "
        "print(sorted(m for m in ('cryptography', 'httpx', 'cloud', 'edge', 'asyncio') if m in sys.modules))"
    )

    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)

    assert loaded.stdout.strip() == "[]"
