"""``aisynergy edge run`` options for the devices: where they connect and where they enrol."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from edge.agent import AgentConfig, EdgeAgent
from edge.cli import EXIT_LISTEN, _agent, edge
from edge.enrol_proxy import parse_listen
from edge.identity import IdentityStore
from tests.edge.support import ThrowawayCA, enrol_node

NODE = "nd-0001"


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


@pytest.fixture
def node_dir(tmp_path: Path, test_ca: ThrowawayCA) -> Path:
    return enrol_node(tmp_path / "node", test_ca, NODE, "mqtts://127.0.0.1:1", hub_url="http://hub").data_dir


def config(node_dir: Path, **changes: object) -> AgentConfig:
    return AgentConfig(node_id=NODE, mqtt_url="mqtts://127.0.0.1:1", data_dir=node_dir, hub_url="http://hub", **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "parsed"), [("off", None), ("OFF", None), ("0.0.0.0:8090", ("0.0.0.0", 8090)), ("[::1]:80", ("::1", 80))]
)
def test_listen_addresses(value: str, parsed: tuple[str, int] | None) -> None:
    assert parse_listen(value) == parsed


@pytest.mark.parametrize("value", ["8090", "host:", ":80", "host:99999", "host:http"])
def test_bad_listen_addresses(value: str) -> None:
    with pytest.raises(ValueError):
        parse_listen(value)


def test_a_bad_device_listen_is_a_usage_error(node_dir: Path) -> None:
    result = CliRunner().invoke(
        edge, ["run", "--node-id", NODE, "--data-dir", str(node_dir), "--device-listen", "nowhere"]
    )

    assert result.exit_code == 2
    assert "--device-listen" in result.output


@pytest.mark.parametrize("option", ["--downstream-mqtt-url", "--device-mqtt-url"])
def test_a_bad_broker_url_for_the_devices_is_a_usage_error(node_dir: Path, option: str) -> None:
    arguments = ["run", "--node-id", NODE, "--data-dir", str(node_dir), option, "tcp://x", "--device-listen", "off"]

    result = CliRunner().invoke(edge, arguments)

    assert result.exit_code == 2
    assert "mqtts://" in result.output


def test_an_explicit_listen_address_that_is_taken_is_fatal(node_dir: Path, busy_port: int) -> None:
    with pytest.raises(SystemExit) as exited:
        _agent(config(node_dir, device_listen=("127.0.0.1", busy_port)), IdentityStore(node_dir), explicit_listen=True)

    assert exited.value.code == EXIT_LISTEN


def test_the_default_listen_address_taken_leaves_the_agent_without_the_proxy(node_dir: Path, busy_port: int) -> None:
    agent = _agent(
        config(node_dir, device_listen=("127.0.0.1", busy_port)), IdentityStore(node_dir), explicit_listen=False
    )

    assert agent.proxy is None
    agent.store.close()


def test_same_broker_means_one_link_and_another_means_two(node_dir: Path) -> None:
    shared = EdgeAgent(config(node_dir, downstream_mqtt_url="mqtts://127.0.0.1:1"))
    shared.store.close()
    separate = EdgeAgent(config(node_dir, downstream_mqtt_url="mqtts://127.0.0.1:2"))
    separate.store.close()

    assert len(shared.links) == 1 and shared.down is shared.up
    assert [link.address for link in separate.links] == [("127.0.0.1", 1), ("127.0.0.1", 2)]


def test_the_proxy_needs_the_hub_url(node_dir: Path) -> None:
    with pytest.raises(ValueError, match="hub URL"):
        EdgeAgent(
            AgentConfig(node_id=NODE, mqtt_url="mqtts://127.0.0.1:1", data_dir=node_dir, device_listen=("127.0.0.1", 0))
        )
