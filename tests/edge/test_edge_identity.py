"""The node identity kept in the data directory: the identity contract for the node tier, and the CLI's use of it."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import ClassVar

from click.testing import CliRunner

from edge.cli import EXIT_IDENTITY, edge
from edge.identity import IdentityStore
from tests.identity_contract import IdentityContract


class TestNodeIdentity(IdentityContract):
    store = IdentityStore
    owner, other = "nd-0001", "nd-0002"
    ids: ClassVar[dict[str, str]] = {"node_id": "nd-0001"}
    url_field = "hub_url"


def test_cli_exits_4_on_identity_mismatch(tmp_path: Path, test_ca) -> None:
    store = IdentityStore(tmp_path)
    store.save(test_ca.issue(store.make_csr("nd-0001"), "nd-0001"), "https://hub")

    result = CliRunner().invoke(edge, ["run", "--node-id", "nd-0002", "--data-dir", str(tmp_path)])

    assert result.exit_code == EXIT_IDENTITY


def test_cli_narrows_a_data_directory_left_open_before_anything_else(tmp_path: Path, test_ca) -> None:
    # Prepare: an earlier version's data directory and key, readable by every user
    store = IdentityStore(tmp_path / "data")
    store.save(test_ca.issue(store.make_csr("nd-0001"), "nd-0001"), "https://hub")
    store.data_dir.chmod(0o755)
    store.key_path.chmod(0o644)

    # Execute: a start that stops at the identity check
    result = CliRunner().invoke(edge, ["run", "--node-id", "nd-0002", "--data-dir", str(store.data_dir)])

    # Assert
    assert result.exit_code == EXIT_IDENTITY
    assert stat.S_IMODE(store.data_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(store.key_path.stat().st_mode) == 0o600


def test_cli_first_start_without_token_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        edge, ["run", "--hub", "http://127.0.0.1:9", "--node-id", "nd-0001", "--data-dir", str(tmp_path)]
    )

    assert result.exit_code == 2
    assert "bootstrap-token" in result.output
