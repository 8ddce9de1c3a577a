"""An idle device agent (connected, heartbeating, no model, update or task) loads only what it uses: the model
host, the updater, the task host and the libraries behind them are imported when a model, an order or a task
needs them (bench/device_rss.py measures what that saves)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cloud.signing import SigningKey
from device.agent import Device
from device.commands import MODEL_COMMANDS
from device.identity import IdentityStore
from device.ota.models import ModelHost, model_commands
from interfaces.deployments import EXECUTION_EVENT, INSTALLED_KEY
from interfaces.ids import new_id
from interfaces.messages import CommandBody, DesiredBody, envelope
from interfaces.topics import DEVICE_DESIRED
from tests.device.conftest import DeviceBroker, EdgeObserver, EnrolmentServer, ThrowawayCA
from tests.device.ota_support import V1, blob_server, make_order
from tests.support import wait_for

pytestmark = pytest.mark.broker
REPO = Path(__file__).resolve().parents[2]

# each is needed only by a model, an update, a task or an enrolment
NOT_IDLE = (
    "numpy", "onnxruntime", "safetensors", "cryptography", "httpx", "bsdiff4",
    "device.runtime", "device.ota.models", "device.ota.updater", "device.ota.download", "device.ota.verify",
    "device.ota.firmware", "device.tasks", "device.training", "device.tensors",
)  # fmt: skip

# The agent's process: the modules it has loaded are written to stdout once a line arrives on stdin.
DUMP_ON_STDIN = """
import json, sys, threading
def dump():
    sys.stdin.readline()
    print(json.dumps(sorted(sys.modules)), flush=True)
threading.Thread(target=dump, daemon=True).start()
"""
SDK = DUMP_ON_STDIN + """
from device import Device
Device(sys.argv[1], sys.argv[2]).run_forever()
"""
CLI = DUMP_ON_STDIN + """
import runpy
sys.argv = ["device.cli", "run", "--device-id", sys.argv[1], "--data-dir", sys.argv[2]]
runpy.run_module("device.cli", run_name="__main__", alter_sys=True)
"""

CLI_FIRST_START = DUMP_ON_STDIN + """
import runpy
device_id, data_dir, url, token = sys.argv[1:]
sys.argv = ["device.cli", "run", "--device-id", device_id, "--data-dir", data_dir, "--enrol-url", url, "--bootstrap-token", token]
runpy.run_module("device.cli", run_name="__main__", alter_sys=True)
"""


def _modules_of_idle_agent(program: str, device_id: str, data_dir: Path, edge: EdgeObserver, *args: str) -> set[str]:
    agent = subprocess.Popen(
        [sys.executable, "-c", program, device_id, str(data_dir), *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True,
    )  # fmt: skip
    try:
        edge.expect("state", state="online")
        edge.expect("heartbeat", seq=1)  # on_connect has run and the heartbeat thread has sent its second beat
        assert agent.stdin is not None and agent.stdout is not None
        agent.stdin.write("dump\n")
        agent.stdin.flush()
        return set(json.loads(agent.stdout.readline()))
    finally:
        agent.terminate()
        agent.wait(10)


def test_an_idle_embedded_agent_imports_no_model_update_task_or_crypto_code(
    enrolled: tuple[str, Path], edge: EdgeObserver
) -> None:
    # Prepare
    device_id, data_dir = enrolled

    # Execute
    loaded = _modules_of_idle_agent(SDK, device_id, data_dir, edge)

    # Assert
    assert "device.agent" in loaded
    assert sorted(m for m in NOT_IDLE if m in loaded) == []


def test_an_idle_device_cli_boots_its_firmware_slots_without_cryptography(
    enrolled: tuple[str, Path], edge: EdgeObserver
) -> None:
    # Prepare: `aisynergy device run` boots the firmware slots at every start (none installed here)
    device_id, data_dir = enrolled

    # Execute
    loaded = _modules_of_idle_agent(CLI, device_id, data_dir, edge)

    # Assert
    booted = {"device.ota.firmware", "device.ota.verify"}  # the slots, and the digest checks an image needs
    assert booted | {"click"} <= loaded
    assert sorted(m for m in NOT_IDLE if m in loaded and m not in booted) == []


def test_a_first_start_of_the_device_cli_runs_the_agent_without_the_enrolment_code(
    tmp_path: Path, device_broker: DeviceBroker, enrolment_server: EnrolmentServer
) -> None:
    # Prepare: a device that has never enrolled
    device_id, data_dir = new_id("dv"), tmp_path / "device"
    enrolment_server.mqtt_url, enrolment_server.heartbeat_s = device_broker.url, 0.2
    enrolment_server.tokens[device_id] = "t" * 43
    edge = EdgeObserver(device_broker, device_id)

    # Execute: it enrols, then the same process runs the agent from the stored identity
    try:
        loaded = _modules_of_idle_agent(CLI_FIRST_START, device_id, data_dir, edge, enrolment_server.url, "t" * 43)
    finally:
        edge.close()

    # Assert
    assert enrolment_server.enrolled == {device_id} and len(enrolment_server.requests) == 1
    assert IdentityStore(data_dir).is_enrolled()
    assert "device.agent" in loaded
    assert sorted(m for m in ("httpx", "cryptography", "device.enrol") if m in loaded) == []


def test_the_model_built_ins_work_before_any_model_is_installed(enrolled: tuple[str, Path], edge: EdgeObserver) -> None:
    # Prepare
    device_id, data_dir = enrolled
    dev = Device(device_id, data_dir)

    with dev:
        edge.expect("state", state="online")

        # Execute
        edge.command(CommandBody(name="models"), b"c-models")
        _, listed = edge.expect("cmd/reply", ok=True)
        edge.command(CommandBody(name="infer", args={"inputs": {"x": [[1.0]]}}), b"c-infer")
        _, refused = edge.expect("cmd/reply", ok=False)

    # Assert
    assert listed["body"]["result"] == {"models": []}
    assert refused["body"]["error_code"] == "failed" and "no model is loaded" in refused["body"]["error"]
    assert dev.models.models() == [] and dev.tasks.workers() == []


def test_the_agent_registers_every_model_command(tmp_path: Path) -> None:
    assert sorted(model_commands(ModelHost(tmp_path))) == sorted(MODEL_COMMANDS)


def test_a_restarted_agent_restores_the_model_it_installed_at_start(
    tmp_path: Path, test_ca: ThrowawayCA, device_broker: DeviceBroker
) -> None:
    # Prepare: a model installed by an order (the updater made at that order), then the agent stopped
    signing = SigningKey.load_or_create(tmp_path / "hub-pki")
    device_id, store = new_id("dv"), IdentityStore(tmp_path / "device")
    edge = EdgeObserver(device_broker, device_id)
    with blob_server() as server:
        issued = test_ca.issue(store.make_csr(device_id), device_id, device_broker.url, heartbeat_s=1.0)
        store.save(issued.model_copy(update={"signing_key_pem": signing.public_pem}), server.url)
        order = make_order(signing, server, V1, "1.0.0")
        body = DesiredBody(version=1, spec={}, deployments=[order], deployments_version=1)
        try:
            with Device(device_id, store.data_dir):
                edge.publish(DEVICE_DESIRED.topic(device_id=device_id), envelope("edge", body).model_dump_json().encode(), retain=True)
                wait_for(lambda: any(b["type"] == EXECUTION_EVENT and b["data"]["state"] == "ACTIVE" for b in edge.bodies("events")), 30, what="ACTIVE")
                edge.expect("reported", timeout=60, version=1)

            # Execute
            restarted = Device(device_id, store.data_dir)
            restarted.start()
            try:
                serving = restarted.models.get()  # start() returned: the model is loaded already
                _, report = edge.expect("reported", timeout=60, version=1)
            finally:
                restarted.stop()
        finally:
            edge.close()

    # Assert
    assert (serving.name, serving.version) == ("classifier", "1.0.0")
    assert report["body"]["status"][INSTALLED_KEY]["model"]["version"] == "1.0.0"
