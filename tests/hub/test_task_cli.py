"""``aisynergy task`` (cloud/cli/task/) without the task API: the SSE decoder on byte streams, the log
follower against a scripted hub (httpx.MockTransport), request bodies built from flags, the commands' output
for documents shaped by interfaces/tasks/, and the dataset upload-or-reuse against the real artefacts API."""

from __future__ import annotations

import hashlib
import io
import json
import re
import struct
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from cloud.cli import deploy
from cloud.cli import task as cli
from cloud.cli.deploy import _Hub
from cloud.cli.task import (
    LogFollower,
    SSEDecoder,
    SSEEvent,
    build_task_body,
    iter_sse,
    parse_accelerator,
    parse_duration,
    upload_inputs,
)  # fmt: skip
from device.algorithm.package import build
from interfaces import API_PREFIX
from interfaces.auth import Role
from interfaces.tasks import (
    BatchInferenceSpec,
    FederatedTrainingSpec,
    MetricSample,
    Placement,
    RetryPolicy,
    TaskCreate,
    TaskDetail,
    TaskLogLine,
    TaskMetrics,
    TaskOutputs,
    TaskProgress,
    TaskPublic,
    TaskState,
    TaskTransition,
    TaskType,
    TensorInfo,
    WorkerPublic,
    WorkerState,
)  # fmt: skip
from tests.hub.conftest import HubUnderTest

NOW = datetime(2025, 5, 1, 12, 0, 0, tzinfo=UTC)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"


# --- the SSE decoder -------------------------------------------------------------------------------


def _events(chunks: list[bytes]) -> list[tuple[str, str, str]]:
    return [(e.event, e.data, e.id) for e in iter_sse(chunks)]


def _bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


STREAM = (
    "\ufeff: keepalive\n"
    "retry: 2500\n"
    "event: log\nid: 1\ndata: {\"id\": 1, \"text\": \"caf\u00e9 \u2713\"}\n\n"
    "event: state\ndata: {\"state\": \"RUNNING\"}\n\n"  # no id: it keeps the last one
    "data: first\ndata:second\ndata\n\n"  # no space after the colon; a field name alone is an empty value
    "id: 7\n\n"  # no data: nothing dispatched, but the id counts
    "event: end\ndata: done\n\n"
    "event: log\ndata: never finished"  # no blank line before the stream ends: dropped
).encode()
EXPECTED = [
    ("log", '{"id": 1, "text": "caf\u00e9 \u2713"}', "1"),
    ("state", '{"state": "RUNNING"}', "1"),
    ("message", "first\nsecond\n", "1"),
    ("end", "done", "7"),
]


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("split", ["whole", "bytewise", "halves"])
def test_sse_decoder_handles_every_line_end_and_any_chunking(newline: str, split: str) -> None:
    # Prepare: one stream, three line-end conventions, cut anywhere (inside a CRLF, inside a UTF-8 sequence)
    data = STREAM.decode().replace("\n", newline).encode()
    chunks = {"whole": [data], "bytewise": _bytewise(data), "halves": [data[: len(data) // 2], data[len(data) // 2 :]]}[split]
    decoder = SSEDecoder()

    # Act
    events = [(e.event, e.data, e.id) for e in iter_sse(chunks, decoder)]

    # Assert
    assert events == EXPECTED
    assert decoder.comments == 1
    assert decoder.retry_ms == 2500
    assert decoder.last_event_id == "7"


def test_sse_decoder_follows_the_specification_examples() -> None:
    # The WHATWG examples: "data" alone and "data:" are empty lines of data; one leading space is removed
    assert _events([b"data\n\ndata\ndata\n\ndata:"]) == [("message", "", ""), ("message", "\n", "")]
    assert _events([b"data:test\n\ndata: test\n\n"]) == [("message", "test", ""), ("message", "test", "")]
    assert _events([b"data:  two spaces\n\n"]) == [("message", " two spaces", "")]
    # an id with NUL is ignored; retry needs digits; unknown fields are ignored; an empty id resets it
    decoder = SSEDecoder()
    got = list(iter_sse([b"id: a\0b\nretry: 1x\nfoo: bar\ndata: x\n\nid\ndata: y\n\n"], decoder))
    assert [(e.data, e.id) for e in got] == [("x", ""), ("y", "")]
    assert decoder.retry_ms is None
    # a BOM only counts at the very start; a CR at the end of a chunk and LF at the start of the next is one line end
    assert _events([b"\xef\xbb", b"\xbfdata: a\r", b"\ndata: b\r", b"\r"]) == [("message", "a\nb", "")]
    assert _events([b"data: \xef\xbb\xbfx\n\n"]) == [("message", "\ufeffx", "")]


def test_sse_decoder_line_by_line_and_json() -> None:
    decoder = SSEDecoder(last_event_id="41")
    assert decoder.line("event: log") is None
    assert decoder.line('data: {"a": 1}') is None
    event = decoder.line("")
    assert isinstance(event, SSEEvent) and event.json() == {"a": 1} and event.id == "41"


# --- the log follower ------------------------------------------------------------------------------


def _sse(event: str, data: Any, id: int | None = None) -> bytes:
    return (f"event: {event}\n" + (f"id: {id}\n" if id is not None else "") + f"data: {json.dumps(data)}\n\n").encode()


def _line(i: int, text: str = "", worker: str | None = "w-1", target: str | None = "dev-1", level: str = "info") -> dict[str, Any]:
    return TaskLogLine(id=i, task_id="task-1", worker_id=worker, target_id=target, ts=NOW, level=level, text=text or f"line {i}").model_dump(mode="json")  # type: ignore[arg-type]


class _Broken(httpx.SyncByteStream):
    """Some bytes, then the connection breaks."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __iter__(self) -> Iterator[bytes]:
        yield self.data
        raise httpx.ReadError("connection reset")


def mock_hub(handler: Callable[[httpx.Request], httpx.Response]) -> _Hub:
    hub = _Hub("http://hub.test", "tok")
    hub.client.close()
    hub.client = httpx.Client(base_url="http://hub.test", transport=httpx.MockTransport(handler))
    return hub


def _stream(body: bytes | httpx.SyncByteStream, status: int = 200) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.Response(status, headers={"content-type": "text/event-stream; charset=utf-8"}, content=body)
    return httpx.Response(status, headers={"content-type": "text/event-stream"}, stream=body)


def test_follower_reconnects_with_last_event_id_and_prints_each_line_once() -> None:
    # Prepare: the first connection breaks after two lines and a state; the second repeats line 2, then ends
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) == 1:
            return _stream(_Broken(_sse("log", _line(1), 1) + _sse("log", _line(2), 2) + _sse("state", {"state": "RUNNING", "reason": "", "progress": {}}) + b": keepalive\n\n"))
        if len(seen) == 2:
            return _stream(b"retry: 250\n\n: keepalive\n\n")  # closes without an end: reconnect after the server's retry
        return _stream(_sse("log", _line(2), 2) + _sse("log", _line(3), 3) + _sse("end", {"state": "SUCCEEDED", "reason": "all done", "progress": {}}))

    lines: list[int] = []
    states: list[str] = []
    sleeps: list[float] = []
    follower = LogFollower(mock_hub(handler), "task-1", on_log=lambda line: lines.append(line["id"]), on_state=lambda d: states.append(d["state"]), after=0, sleep=sleeps.append)

    # Act
    end = follower.run()

    # Assert
    assert end == {"state": "SUCCEEDED", "reason": "all done", "progress": {}}
    assert lines == [1, 2, 3]
    assert states == ["RUNNING"]
    assert [r.url.path for r in seen] == [API_PREFIX + "/tasks/task-1/logs"] * 3
    assert all(r.headers["accept"] == "text/event-stream" and r.headers["authorization"] == "Bearer tok" for r in seen)
    assert seen[0].url.params.get("after") == "0" and "last-event-id" not in seen[0].headers
    assert seen[1].headers["last-event-id"] == "2" and "after" not in seen[1].url.params
    assert seen[2].headers["last-event-id"] == "2"
    assert sleeps == [0.5, 0.25]


def test_follower_gives_up_on_a_refusal_or_after_failures_in_a_row() -> None:
    # a 404 is final at once
    not_found = mock_hub(lambda r: httpx.Response(404, json={"code": "not_found", "detail": "no task task-9", "status": 404}))
    with pytest.raises(click.ClickException, match="404 not_found: no task task-9"):
        LogFollower(not_found, "task-9", sleep=lambda s: None).run()
    # a hub that answers JSON instead of an event stream
    plain = mock_hub(lambda r: httpx.Response(200, json={"items": [], "next_cursor": None}))
    with pytest.raises(click.ClickException, match="not an event stream"):
        LogFollower(plain, "task-1", sleep=lambda s: None).run()
    # 503s and unreachable: retried with a doubling delay, then given up
    calls: list[int] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) % 2:
            raise httpx.ConnectError("refused")
        return httpx.Response(503, json={"code": "unavailable", "status": 503})

    sleeps: list[float] = []
    with pytest.raises(click.ClickException, match="lost the log stream of task-1"):
        LogFollower(mock_hub(flaky), "task-1", sleep=sleeps.append, max_failures=5, max_delay_s=3).run()
    assert len(calls) == 5
    assert sleeps == [0.5, 1.0, 2.0, 3.0]


def test_logs_follow_command_prints_lines_and_ends() -> None:
    # Prepare
    body = _sse("log", _line(1, "[hub] loading model", worker=None, target=None), 1) + _sse("log", _line(2, "chunk 0 done", level="warning"), 2)
    body += _sse("state", {"state": "SUCCEEDED", "reason": "", "progress": {"workers": {"SUCCEEDED": 1}}}) + _sse("end", {"state": "SUCCEEDED", "reason": "", "progress": {}})
    hub = mock_hub(lambda r: _stream(body))

    # Act
    human = CliRunner().invoke(cli.task, ["logs", "-f", "task-1"], obj=hub)
    machine = CliRunner().invoke(cli.task, ["logs", "--follow", "--json", "task-1"], obj=hub)

    # Assert
    assert human.exit_code == 0, human.output
    assert human.stdout.splitlines() == [
        "2025-05-01T12:00:00Z info    [hub] loading model",
        "2025-05-01T12:00:00Z warning [dev-1] chunk 0 done",
    ]
    assert "SUCCEEDED" in human.stderr
    assert machine.exit_code == 0, machine.output
    assert [json.loads(line)["id"] for line in machine.stdout.splitlines()] == [1, 2]


def test_logs_pages_through_next_cursor() -> None:
    # Prepare: pages of two lines; next_cursor is the last line id, null at the end
    asked: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        asked.append(params)
        after, limit = int(params.get("after", 0)), min(2, int(params["limit"]))
        items = [_line(i) for i in range(after + 1, min(after + limit, 5) + 1)]
        return httpx.Response(200, json={"items": items, "next_cursor": str(items[-1]["id"]) if items[-1]["id"] < 5 else None})

    # Act
    result = CliRunner().invoke(cli.task, ["logs", "task-1", "--after", "0"], obj=mock_hub(handler))
    limited = CliRunner().invoke(cli.task, ["logs", "task-1", "--limit", "3"], obj=mock_hub(handler))

    # Assert
    assert result.exit_code == 0, result.output
    assert [line.split()[-1] for line in result.output.splitlines()] == ["1", "2", "3", "4", "5"]
    assert [a.get("after") for a in asked[:3]] == ["0", "2", "4"]
    assert len(limited.output.splitlines()) == 3


# --- request bodies --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("1.5m", 90), ("2h", 7200), ("1d", 86400), ("500ms", 0.5), (".5", 0.5)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_parse_duration_and_accelerator_refuse_nonsense() -> None:
    for text in ("", "5x", "m", "-3", "1e3"):
        with pytest.raises(click.BadParameter):
            parse_duration(text)
    assert parse_accelerator("gpu") == {"type": "gpu"}
    assert parse_accelerator("GPU:2") == {"type": "gpu", "count": 2}
    assert parse_accelerator("npu:1:training") == {"type": "npu", "count": 1, "purpose": "training"}
    for text in ("", "gpu:two", "gpu:1:gaming", "gpu:1:training:x"):
        with pytest.raises(click.BadParameter):
            parse_accelerator(text)


def test_batch_body_from_flags() -> None:
    # Act
    body = build_task_body(
        "batch_inference", model="detector:1.2.0", inputs="art-1", chunk_size=32, input_name="images", selector="zone=a", min_nodes=2,
        max_nodes=4, accelerators=["gpu:1:inference"], timeout=3600.4, worker_timeout=20, heartbeat=2, max_attempts=5, backoff=0.5,
        hold=True, name="nightly",
    )  # fmt: skip

    # Assert
    assert body == {
        "type": "batch_inference", "name": "nightly",
        "spec": {"model": {"name": "detector", "version": "1.2.0"}, "inputs": "art-1", "chunk_size": 32, "input_name": "images"},
        "placement": {"selector": "zone=a", "min_nodes": 2, "max_nodes": 4, "accelerators": [{"type": "gpu", "count": 1, "purpose": "inference"}]},
        "timeout_s": 3600, "worker_timeout_s": 20, "heartbeat_s": 2, "retry": {"max_attempts": 5, "backoff_s": 0.5}, "start": False,
    }  # fmt: skip
    created = TaskCreate.model_validate(body)
    assert created.start is False and created.placement.accelerators[0].purpose == "inference"
    assert BatchInferenceSpec.model_validate(created.spec).chunk_size == 32


def test_training_goes_to_sites_unless_devices_are_asked_for() -> None:
    # Act
    on_sites = build_task_body("training", algorithm="cnn:1.0.0", datasets=["train=digits"], steps=4)
    on_devices = build_task_body("training", algorithm="cnn:1.0.0", datasets=["train=digits"], steps=4, devices=True, selector="tier=board")

    # Assert
    assert on_sites["placement"] == {"target": "node"}
    assert on_devices["placement"] == {"selector": "tier=board"}  # the default target: devices
    assert TaskCreate.model_validate(on_devices).placement.target.value == "device"


def test_whole_model_federated_body_from_flags() -> None:
    # Act: on sites by default, on devices with --devices; a variant's selector may hold "=" itself
    on_sites = build_task_body(
        "federated_training", algorithm="digits-torch-cnn:1.0.0", datasets=["train=digits-train"], initial="art-init", rounds=5, local_fits=2,
        variants=["framework=numpy=digits-numpy-cnn:1.0.0"], config='{"epochs": 1}', strategy="fedadam", output="digits-fl",
    )  # fmt: skip
    on_devices = build_task_body("federated_training", algorithm="digits-numpy-cnn:1.0.0", datasets=["train=train"], initial="art-init", rounds=3,
                                 devices=True, selector="tier=board")  # fmt: skip

    # Assert
    assert on_sites == {
        "type": "federated_training",
        "spec": {
            "algorithm": {"name": "digits-torch-cnn", "version": "1.0.0"}, "output": {"name": "digits-fl"}, "datasets": {"train": "digits-train"},
            "variants": [{"selector": "framework=numpy", "algorithm": {"name": "digits-numpy-cnn", "version": "1.0.0"}}], "config": {"epochs": 1},
            "initial_parameters": "art-init", "rounds": 5, "strategy": "fedadam", "local_fits": 2,
        },
        "placement": {"target": "node"},
    }  # fmt: skip
    spec = FederatedTrainingSpec.model_validate(on_sites["spec"])
    assert spec.whole and spec.variants[0].selector == "framework=numpy" and spec.variants[0].config is None
    assert on_devices["placement"] == {"selector": "tier=board"}
    assert TaskCreate.model_validate(on_devices).placement.target.value == "device"


def test_last_layer_federated_body_keeps_its_placement_and_spec() -> None:
    # Act: --model trains an installed model's last layer on devices; --rounds and --strategy apply to both modes
    body = build_task_body("federated_training", cli.load_spec('{"dataset": "camera", "local_steps": 40}'), model="digits:1.0.0", rounds=20, strategy="median")
    whole_from_spec = build_task_body("federated_training", cli.load_spec('{"algorithm": {"name": "a", "version": "1"}, "initial_parameters": "art-1"}'), rounds=2)

    # Assert
    assert body == {"type": "federated_training", "spec": {"dataset": "camera", "local_steps": 40, "model": {"name": "digits", "version": "1.0.0"}, "rounds": 20, "strategy": "median"}}
    assert whole_from_spec["placement"] == {"target": "node"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "digits", "local_fits": 2}, "--local-fits: for whole-model tasks (--algorithm) only; a last-layer task (--model) names its dataset"),
        ({"model": "digits", "variants": ["a=b=c:1"], "initial": "art-1"}, "--variant, --initial: for whole-model tasks (--algorithm) only"),
        ({"model": "digits", "datasets": ["train=camera"], "config": "{}"}, "--dataset, --config: for whole-model tasks"),
        ({"spec": {"model": {"name": "digits"}}, "local_fits": 2}, "--local-fits: for whole-model tasks"),
        ({"model": "digits", "algorithm": "a:1"}, "give one of --model (its last layer is trained) or --algorithm (the whole model is trained)"),
        ({"algorithm": "a:1", "initial": "art-1", "rounds": 2, "steps": 4}, "--steps: for training tasks only, not federated_training"),
        ({"algorithm": "a:1", "datasets": ["train=t"], "rounds": 2}, "spec: a whole-model task starts from initial_parameters"),
        ({"algorithm": "a:1", "initial": "art-1"}, "spec.rounds (--rounds): Field required"),
        ({"algorithm": "a:1", "initial": "art-1", "rounds": 2, "local_fits": 0}, "spec.local_fits (--local-fits)"),
        ({"type": "training", "algorithm": "a:1", "steps": 4, "rounds": 2, "variants": ["x=y=a:1"]}, "--rounds, --variant: for federated_training tasks only, not training"),
        ({"type": "inference", "model": "m", "strategy": "fedavg"}, "--strategy: for federated_training tasks only, not inference"),
    ],
)
def test_federated_options_that_do_not_fit_the_mode_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(click.UsageError, match=re.escape(message)):
        build_task_body(kwargs.pop("type", "federated_training"), kwargs.pop("spec", None), **kwargs)


@pytest.mark.parametrize("text", ["digits-numpy-cnn:1.0.0", "=digits-numpy-cnn:1.0.0", "framework=numpy=digits-numpy-cnn", "framework=numpy="])
def test_variant_needs_a_selector_and_a_versioned_algorithm(text: str) -> None:
    with pytest.raises(click.BadParameter, match="--variant|SELECTOR=NAME:VERSION|NAME:VERSION"):
        build_task_body("federated_training", algorithm="a:1", initial="art-1", rounds=2, variants=[text])


def test_spec_file_is_the_base_and_flags_override(tmp_path: Path) -> None:
    # Prepare
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"model": {"name": "old"}, "report_interval_s": 2}))

    # Act
    body = build_task_body("inference", cli.load_spec(f"@{spec_file}"), model="new", duration=parse_duration("1h"), nodes=True, ids="gw-1, gw-2,")
    inline = build_task_body("inference", cli.load_spec('{"model": {"name": "m", "version": "2"}}'))

    # Assert
    assert body == {
        "type": "inference", "spec": {"model": {"name": "new"}, "report_interval_s": 2, "duration_s": 3600.0},
        "placement": {"target": "node", "ids": ["gw-1", "gw-2"]},
    }  # fmt: skip
    assert inline == {"type": "inference", "spec": {"model": {"name": "m", "version": "2"}}}
    assert TaskCreate.model_validate(inline).placement == Placement()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"type": "inference"}, "spec.model (--model): Field required"),
        ({"type": "batch_inference", "model": "m"}, "spec.inputs (--inputs): Field required"),
        ({"type": "inference", "model": "m", "accelerators": ["xpu"]}, "placement.accelerators.0.type (--accelerator)"),
        ({"type": "inference", "model": "m", "heartbeat": 30}, "heartbeat_s must be below worker_timeout_s"),
        ({"type": "inference", "model": "m", "min_nodes": 3, "max_nodes": 2}, "max_nodes is below min_nodes"),
        ({"type": "batch_inference", "model": "m", "inputs": "a", "chunk_size": 0}, "spec.chunk_size (--chunk-size)"),
        ({"type": "inference", "model": "m", "ids": "a,a"}, "ids must not repeat"),
    ],
)
def test_invalid_bodies_name_the_flag(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(click.UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        build_task_body(kwargs.pop("type"), **kwargs)


def test_spec_must_be_a_json_object(tmp_path: Path) -> None:
    for text in ("[1]", "{nope", f"@{tmp_path / 'missing.json'}"):
        with pytest.raises(click.BadParameter):
            cli.load_spec(text)


# --- the commands, against documents shaped by the contract -----------------------------------------


def _task(state: TaskState = TaskState.RUNNING, **over: Any) -> dict[str, Any]:
    doc = TaskDetail(
        id="task-1", name="nightly", type=TaskType.BATCH_INFERENCE, spec={"model": {"name": "detector"}, "inputs": "art-1"}, placement=Placement(),
        timeout_s=None, worker_timeout_s=30, heartbeat_s=5, retry=RetryPolicy(), state=state, held=False, attempt=1,
        progress=TaskProgress(items_total=100, items_done=40, chunks_total=4, chunks_done=1, workers={WorkerState.RUNNING: 2}),
        created_at=NOW, updated_at=NOW, started_at=NOW, finished_at=None, deadline_at=None,
        history=[TaskTransition(from_state=None, to_state="PENDING", at=NOW), TaskTransition(from_state="PENDING", to_state="SCHEDULED", at=NOW, reason="2 targets")],
    ).model_dump(mode="json")  # fmt: skip
    return {**doc, **over}


class ScriptedHub:
    """A hub answering from a table of (method, path) -> response; records the requests."""

    def __init__(self, routes: dict[tuple[str, str], Any]) -> None:
        self.routes = routes
        self.requests: list[httpx.Request] = []
        self.hub = mock_hub(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.routes.get((request.method, request.url.path.removeprefix(API_PREFIX)))
        if answer is None:
            return httpx.Response(404, json={"code": "not_found", "status": 404, "detail": request.url.path})
        if callable(answer):
            answer = answer(request)
        if isinstance(answer, httpx.Response):
            return answer
        return httpx.Response(200, json=answer)

    def bodies(self, method: str, path: str) -> list[Any]:
        return [json.loads(r.content) for r in self.requests if r.method == method and r.url.path == API_PREFIX + path]


def test_create_uploads_inputs_posts_the_body_and_watches_to_the_end(tmp_path: Path) -> None:
    # Prepare: a hub that has no such dataset yet, accepts the task, then streams it to SUCCEEDED
    inputs = tmp_path / "frames.npy"
    np.save(inputs, np.zeros((10, 3), dtype=np.float32))
    sha = hashlib.sha256(inputs.read_bytes()).hexdigest()
    final = _task(TaskState.SUCCEEDED, progress={"items_total": 10, "items_done": 10, "workers": {"SUCCEEDED": 2}})
    gets = iter([_task(TaskState.PENDING), final])
    stream = _sse("state", {"state": "RUNNING", "reason": "", "progress": {"items_total": 10, "items_done": 4, "workers": {"RUNNING": 2}}})
    stream += _sse("log", _line(1, "chunk 0 done"), 1) + _sse("end", {"state": "SUCCEEDED", "reason": "", "progress": {}})
    hub = ScriptedHub({
        ("GET", "/artifacts"): {"items": [], "next_cursor": None},
        ("POST", "/artifacts"): httpx.Response(201, json={"id": "art-new", "sha256": sha}),
        ("POST", "/tasks"): httpx.Response(201, json=_task(TaskState.PENDING)),
        ("GET", "/tasks/task-1"): lambda r: next(gets),
        ("GET", "/tasks/task-1/logs"): _stream(stream),
    })  # fmt: skip

    # Act
    result = CliRunner().invoke(cli.task, [
        "create", "--type", "batch_inference", "--model", "detector", "--inputs", str(inputs), "--chunk-size", "5", "--ids", "dev-1,dev-2",
        "--accelerator", "gpu", "--accelerator", "npu:2", "--watch",
    ], obj=hub.hub)  # fmt: skip

    # Assert
    assert result.exit_code == 0, result.output
    listing = next(r for r in hub.requests if r.method == "GET" and r.url.path.endswith("/artifacts"))
    assert dict(listing.url.params) == {"kind": "dataset", "name": f"inputs-{sha[:16]}", "limit": "500"}
    upload = next(r for r in hub.requests if r.method == "POST" and r.url.path.endswith("/artifacts"))
    form = upload.content
    for field, value in (("kind", "dataset"), ("name", f"inputs-{sha[:16]}"), ("version", "1"), ("format", "npy")):
        assert f'name="{field}"\r\n\r\n{value}\r\n'.encode() in form
    assert inputs.read_bytes() in form
    [body] = hub.bodies("POST", "/tasks")
    assert body == {
        "type": "batch_inference", "spec": {"model": {"name": "detector"}, "inputs": "art-new", "chunk_size": 5},
        "placement": {"ids": ["dev-1", "dev-2"], "accelerators": [{"type": "gpu"}, {"type": "npu", "count": 2}]},
    }  # fmt: skip
    assert "uploaded dataset art-new" in result.stderr
    assert result.stdout.splitlines()[0] == "task-1 PENDING"
    assert result.stdout.splitlines()[-1] == "task-1 SUCCEEDED"
    assert "10/10" in result.stdout  # the live view's last frame


def test_create_watch_exits_1_unless_succeeded_and_json_mode() -> None:
    # Prepare
    failed = _task(TaskState.FAILED, reason="chunk 3 failed 3 times")
    hub = ScriptedHub({
        ("POST", "/tasks"): httpx.Response(201, json=_task(TaskState.PENDING)),
        ("GET", "/tasks/task-1"): failed,
        ("GET", "/tasks/task-1/logs"): _stream(_sse("end", {"state": "FAILED", "reason": "chunk 3 failed 3 times", "progress": {}})),
    })  # fmt: skip
    args = ["create", "--type", "batch_inference", "--model", "m", "--inputs", "art-existing", "--watch"]

    # Act
    human = CliRunner().invoke(cli.task, args, obj=hub.hub)
    machine = CliRunner().invoke(cli.task, [*args, "--json"], obj=hub.hub)
    plain = CliRunner().invoke(cli.task, ["create", "--type", "inference", "--model", "m", "--json"], obj=hub.hub)

    # Assert
    assert human.exit_code == 1, human.output
    assert human.stdout.splitlines()[-1] == "task-1 FAILED: chunk 3 failed 3 times"
    assert machine.exit_code == 1
    assert json.loads(machine.stdout)["state"] == "FAILED"
    assert plain.exit_code == 0 and json.loads(plain.stdout)["id"] == "task-1"
    assert not [r for r in hub.requests if r.url.path.endswith("/artifacts")]  # an artefact id is used as it is
    assert hub.bodies("POST", "/tasks")[0]["spec"]["inputs"] == "art-existing"


def test_create_refuses_before_any_request(tmp_path: Path) -> None:
    hub = ScriptedHub({})
    csv = tmp_path / "rows.csv"
    csv.write_text("1,2\n")
    for args in (
        ["--type", "batch_inference", "--model", "m", "--inputs", str(csv)], ["--type", "inference", "--model", "m", "--spec", "[]"],
        ["--type", "inference"], ["--type", "inference", "--model", "m", "--ids", "a", "--selector", "x=y"],
        ["--type", "batch_inference", "--model", "m", "--inputs", "nothing-here.npy"], ["--type", "inference", "--model", "m", "--duration", "soon"],
    ):  # fmt: skip
        result = CliRunner().invoke(cli.task, ["create", *args], obj=hub.hub)
        assert result.exit_code == 2, (args, result.output)
    assert hub.requests == []


def test_create_sends_the_whole_model_spec_and_refuses_mixed_options() -> None:
    # Prepare
    hub = ScriptedHub({("POST", "/tasks"): httpx.Response(201, json=_task(TaskState.PENDING))})
    whole = ["create", "--type", "federated_training", "--algorithm", "digits-torch-cnn:1.0.0", "--dataset", "train=train", "--initial", "art-init", "--rounds", "5"]

    # Act
    result = CliRunner().invoke(cli.task, [*whole, "--local-fits", "2", "--variant", "framework=numpy=digits-numpy-cnn:1.0.0", "--devices", "--selector", "tier=board"], obj=hub.hub)
    refused = {
        "local fits, last layer": ["create", "--type", "federated_training", "--model", "digits", "--spec", '{"dataset": "camera", "rounds": 2}', "--local-fits", "2"],
        "both modes": [*whole, "--model", "digits"], "steps": [*whole, "--steps", "3"], "rounds, training": ["create", "--type", "training", "--algorithm", "a:1", "--steps", "2", "--rounds", "2"],
        "bad variant": [*whole, "--variant", "digits-numpy-cnn:1.0.0"], "bad strategy": [*whole, "--strategy", "fedsgd"],
    }  # fmt: skip
    outcomes = {key: CliRunner().invoke(cli.task, args, obj=hub.hub) for key, args in refused.items()}

    # Assert
    assert result.exit_code == 0, result.output
    [body] = hub.bodies("POST", "/tasks")
    assert body == {
        "type": "federated_training",
        "spec": {
            "algorithm": {"name": "digits-torch-cnn", "version": "1.0.0"}, "datasets": {"train": "train"}, "initial_parameters": "art-init", "rounds": 5,
            "local_fits": 2, "variants": [{"selector": "framework=numpy", "algorithm": {"name": "digits-numpy-cnn", "version": "1.0.0"}}],
        },
        "placement": {"selector": "tier=board"},
    }  # fmt: skip
    for key, outcome in outcomes.items():
        assert outcome.exit_code == 2, (key, outcome.output)
    assert "--local-fits: for whole-model tasks (--algorithm) only" in outcomes["local fits, last layer"].output
    assert "give one of --model" in outcomes["both modes"].output
    assert "--steps: for training tasks only" in outcomes["steps"].output
    assert "--rounds: for federated_training tasks only" in outcomes["rounds, training"].output
    assert "SELECTOR=NAME:VERSION" in outcomes["bad variant"].output
    assert len(hub.requests) == 1


def test_list_get_workers_metrics_outputs_and_actions_print_the_documents(tmp_path: Path) -> None:
    # Prepare
    public = TaskPublic.model_validate(_task()).model_dump(mode="json")
    worker = WorkerPublic(
        id="wrk-1", task_id="task-1", target_kind="device", target_id="dev-1", role="worker", state=WorkerState.RUNNING, attempt=1, items_assigned=50,
        items_done=20, detail="chunk 1", created_at=NOW, started_at=NOW, finished_at=None, last_report_at=NOW,
    ).model_dump(mode="json")  # type: ignore[arg-type]  # fmt: skip
    sample = MetricSample(worker_id="wrk-1", target_id="dev-1", ts=NOW, values={"items_per_s": 12.5, "latency_ms": 3.25})
    metrics = TaskMetrics(task_id="task-1", totals={"items_per_s": 12.5}, workers={"wrk-1": sample}, series=[sample]).model_dump(mode="json")
    outputs = TaskOutputs(
        task_id="task-1", state=TaskState.SUCCEEDED, complete=True, items_total=100, items_done=100,
        tensors=[TensorInfo(name="scores", dtype="F32", shape=[100, 10])], content_url=f"{API_PREFIX}/tasks/task-1/outputs/content",
    ).model_dump(mode="json")  # fmt: skip
    content = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    hub = ScriptedHub({
        ("GET", "/tasks"): lambda r: {"items": [public], "next_cursor": None},
        ("GET", "/tasks/task-1"): _task(),
        ("GET", "/tasks/task-1/workers"): [worker],
        ("GET", "/tasks/task-1/metrics"): metrics,
        ("GET", "/tasks/task-1/outputs"): outputs,
        ("GET", "/tasks/task-1/outputs/content"): httpx.Response(200, content=content, headers={"content-type": "application/octet-stream"}),
        ("GET", "/tasks/task-2/outputs/content"): httpx.Response(409, json={"code": "conflict", "status": 409, "detail": "the outputs are incomplete"}),
        ("POST", "/tasks/task-1/pause"): {**public, "state": "PAUSED"},
        ("POST", "/tasks/task-1/resume"): httpx.Response(409, json={"code": "illegal_transition", "status": 409, "detail": "no", "current_state": "SUCCEEDED"}),
        ("DELETE", "/tasks/task-1"): httpx.Response(204),
    })  # fmt: skip
    run = lambda *args: CliRunner().invoke(cli.task, list(args), obj=hub.hub)  # noqa: E731
    out = tmp_path / "out.safetensors"

    # Act
    results = {
        "list": run("list", "--state", "RUNNING", "--type", "batch_inference"), "list_json": run("list", "--json"), "get": run("get", "task-1"),
        "get_json": run("get", "task-1", "--json"), "workers": run("workers", "task-1"), "metrics": run("metrics", "task-1", "--series", "--worker", "wrk-1"),
        "outputs": run("outputs", "task-1"), "download": run("outputs", "task-1", "--out", str(out)), "refused": run("outputs", "task-2", "--out", str(tmp_path / "no")),
        "pause": run("pause", "task-1"), "resume": run("resume", "task-1"), "delete": run("delete", "task-1"),
    }  # fmt: skip

    # Assert
    for key in ("list", "list_json", "get", "get_json", "workers", "metrics", "outputs", "download", "pause", "delete"):
        assert results[key].exit_code == 0, (key, results[key].output)
    listing = next(r for r in hub.requests if r.url.path == API_PREFIX + "/tasks")
    assert dict(listing.url.params) == {"state": "RUNNING", "type": "batch_inference", "limit": "100"}
    assert "task-1" in results["list"].output and "40/100 items" in results["list"].output and "RUNNING 2" in results["list"].output
    assert json.loads(results["list_json"].output)[0]["id"] == "task-1"
    assert "2 targets" in results["get"].output and "SCHEDULED" in results["get"].output
    assert json.loads(results["get_json"].output)["history"][1]["reason"] == "2 targets"
    assert "wrk-1" in results["workers"].output and "device dev-1" in results["workers"].output and "20/50" in results["workers"].output
    metrics_request = next(r for r in hub.requests if r.url.path.endswith("/metrics"))
    assert dict(metrics_request.url.params) == {"series": "true", "worker": "wrk-1"}
    assert "latency_ms=3.25" in results["metrics"].output and "items_per_s" in results["metrics"].output
    assert "complete" in results["outputs"].output and "100x10" in results["outputs"].output
    assert out.read_bytes() == content
    assert results["refused"].exit_code == 1 and "409 conflict: the outputs are incomplete" in results["refused"].output
    assert not (tmp_path / "no").exists() and not (tmp_path / "no.part").exists()
    assert results["pause"].output.strip() == "task-1 PAUSED"
    assert results["resume"].exit_code == 1 and "illegal_transition" in results["resume"].output and "current state SUCCEEDED" in results["resume"].output
    assert results["delete"].output.strip() == "task-1 deleted"


# --- inputs: upload once, then reuse (the real artefacts API) ---------------------------------------


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header: dict[str, Any] = {}
    data = io.BytesIO()
    for name, array in tensors.items():
        start = data.tell()
        data.write(np.ascontiguousarray(array).tobytes())
        header[name] = {"dtype": {"float32": "F32", "int64": "I64"}[str(array.dtype)], "shape": list(array.shape), "data_offsets": [start, data.tell()]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data.getvalue()


@pytest.fixture
def real_hub(sqlite_hub: HubUnderTest) -> _Hub:
    hub = _Hub("http://testserver", sqlite_hub.tokens[Role.OPERATOR])
    hub.client.close()
    hub.client = sqlite_hub.client
    return hub


def test_upload_inputs_once_then_reuse(real_hub: _Hub, sqlite_hub: HubUnderTest, tmp_path: Path) -> None:
    # Prepare
    npy = tmp_path / "frames.npy"
    np.save(npy, np.arange(24, dtype=np.float32).reshape(6, 4))
    st = tmp_path / "frames.safetensors"
    st.write_bytes(_safetensors({"images": np.ones((3, 2), dtype=np.float32)}))

    # Act
    first, reused_first = upload_inputs(real_hub, npy)
    second, reused_second = upload_inputs(real_hub, npy)
    other, _ = upload_inputs(real_hub, st)

    # Assert
    assert (reused_first, reused_second) == (False, True)
    assert first == second != other
    doc = sqlite_hub.get(f"/artifacts/{first}").json()
    sha = hashlib.sha256(npy.read_bytes()).hexdigest()
    assert (doc["kind"], doc["name"], doc["version"], doc["format"], doc["sha256"]) == ("dataset", f"inputs-{sha[:16]}", "1", "npy", sha)
    assert sqlite_hub.get(f"/artifacts/{other}").json()["format"] == "safetensors"
    assert len(sqlite_hub.get("/artifacts", params={"kind": "dataset"}).json()["items"]) == 2


def test_upload_inputs_reuses_the_id_of_a_409(real_hub: _Hub, sqlite_hub: HubUnderTest, tmp_path: Path) -> None:
    # Prepare: someone uploaded the same file meanwhile; our listing did not see it (a race)
    npy = tmp_path / "frames.npy"
    np.save(npy, np.zeros((2, 2), dtype=np.float32))
    stored, _ = upload_inputs(real_hub, npy)

    class Racing(_Hub):
        def call(self, method: str, path: str, **kwargs: Any) -> Any:
            if method == "GET" and path == "/artifacts":
                return {"items": [], "next_cursor": None}
            return super().call(method, path, **kwargs)

    racing = Racing("http://testserver", real_hub.token)
    racing.client.close()
    racing.client = real_hub.client

    # Act
    artifact_id, reused = upload_inputs(racing, npy)

    # Assert
    assert (artifact_id, reused) == (stored, True)
    assert len(sqlite_hub.get("/artifacts", params={"kind": "dataset"}).json()["items"]) == 1


def test_upload_inputs_refuses_other_bytes_under_the_name_and_wrong_files(real_hub: _Hub, sqlite_hub: HubUnderTest, tmp_path: Path) -> None:
    # Prepare: the name our file maps to holds other bytes
    npy = tmp_path / "frames.npy"
    np.save(npy, np.zeros((2, 2), dtype=np.float32))
    name = f"inputs-{hashlib.sha256(npy.read_bytes()).hexdigest()[:16]}"
    squatter = tmp_path / "other.npy"
    np.save(squatter, np.ones((2, 2), dtype=np.float32))
    with squatter.open("rb") as f:
        r = sqlite_hub.request("POST", "/artifacts", Role.OPERATOR, data={"kind": "dataset", "name": name, "version": "1", "format": "npy"}, files={"file": ("x.npy", f)})
    assert r.status_code == 201, r.text
    csv = tmp_path / "frames.csv"
    csv.write_text("1,2\n")

    # Act / Assert
    with pytest.raises(click.ClickException, match="holds other bytes"):
        upload_inputs(real_hub, npy)
    with pytest.raises(click.BadParameter, match=".npy or .safetensors"):
        upload_inputs(real_hub, csv)
    viewer = _Hub("http://testserver", sqlite_hub.tokens[Role.VIEWER])
    viewer.client.close()
    viewer.client = sqlite_hub.client
    fresh = tmp_path / "fresh.npy"
    np.save(fresh, np.full((1, 1), 7, dtype=np.float32))
    with pytest.raises(click.ClickException, match="403 forbidden"):
        upload_inputs(viewer, fresh)


# --- a whole-model federated task, as the README makes it (the real hub) ---------------------------


def test_whole_model_federated_task_from_the_readme(real_hub: _Hub, sqlite_hub: HubUnderTest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: both examples stored as algorithms; the initial parameters from the numpy example's initial_parameters()
    for source in (EXAMPLES / "torch_cnn", EXAMPLES / "numpy_cnn"):
        manifest = json.loads((source / "algorithm.json").read_text())
        fields = {"kind": "algorithm", "name": manifest["name"], "version": manifest["version"], "format": "zip"}
        r = sqlite_hub.request("POST", "/artifacts", Role.OPERATOR, data=fields, files={"file": ("a.zip", build(source, tmp_path / "dist").read_bytes())})
        assert r.status_code == 201, r.text
    np.savez(tmp_path / "train.npz", x=np.zeros((4, 1, 8, 8), dtype=np.float32), y=np.arange(4, dtype=np.int64))
    monkeypatch.syspath_prepend(str(EXAMPLES / "numpy_cnn"))
    from numpy_cnn.client import NumpyCNN
    from safetensors.numpy import save_file

    initial = tmp_path / "digits-cnn-initial.safetensors"
    save_file(NumpyCNN({"seed": 0}, {"train": str(tmp_path / "train.npz")}).initial_parameters(), str(initial))
    monkeypatch.setattr(deploy, "_client", lambda *args: sqlite_hub.client)

    # Act: aisynergy deploy upload, then aisynergy task create
    uploaded = CliRunner().invoke(deploy.deploy, [
        "--hub", "http://testserver", "--token", sqlite_hub.tokens[Role.OPERATOR], "upload", str(initial), "--kind", "model", "--name", "digits-cnn-initial",
        "--version", "1.0.0", "--format", "safetensors",
    ])  # fmt: skip
    artifact_id = uploaded.output.split()[0] if uploaded.exit_code == 0 else ""
    created = CliRunner().invoke(cli.task, [
        "create", "--type", "federated_training", "--algorithm", "digits-torch-cnn:1.0.0", "--dataset", "train=digits-train", "--dataset", "test=digits-test",
        "--config", '{"epochs": 1}', "--initial", artifact_id, "--rounds", "5", "--local-fits", "2", "--variant", "framework=numpy=digits-numpy-cnn:1.0.0",
        "--output", "digits-fl", "--json",
    ], obj=real_hub)  # fmt: skip

    # Assert: the hub admitted it (algorithms stored, configurations valid, the parameters a safetensors model) and waits for sites
    assert uploaded.exit_code == 0, uploaded.output
    assert created.exit_code == 0, created.output
    doc = sqlite_hub.get(f"/tasks/{json.loads(created.output)['id']}").json()
    assert doc["state"] == "PENDING" and doc["placement"]["target"] == "node"
    spec = FederatedTrainingSpec.model_validate(doc["spec"])
    assert (doc["spec"]["algorithm"]["name"], spec.initial_parameters, spec.rounds, spec.local_fits, spec.output.name) == ("digits-torch-cnn", artifact_id, 5, 2, "digits-fl")
    assert [(v.selector, v.algorithm.name) for v in spec.variants] == [("framework=numpy", "digits-numpy-cnn")]


def test_outputs_print_the_privacy_spent_and_the_cross_site_matrix() -> None:
    # Prepare: a federated task's outputs: the published model, each device's spend, the cross-site scores
    from interfaces.tasks import CrossScore

    def score(evaluator: str, model: str, accuracy: float) -> CrossScore:
        return CrossScore(evaluator=evaluator, model=model, loss=0.5, num_examples=90, metrics={"accuracy": accuracy})

    outputs = TaskOutputs(
        task_id="task-1", state=TaskState.SUCCEEDED, complete=True, items_total=None, items_done=None, artifacts=["art-1"],
        evaluation=[score("dev-a", "global", 0.91), score("dev-a", "dev-a", 0.95), score("dev-a", "dev-b", 0.72), score("dev-b", "global", 0.88),
                    score("dev-b", "dev-a", 0.61), score("dev-b", "dev-b", 0.93)],
    ).model_dump(mode="json")  # fmt: skip
    outputs["privacy"] = [{"device_id": "dev-a", "dataset": "digits", "state": "spent", "steps": 2, "epsilon": 1.2345}]
    hub = ScriptedHub({("GET", "/tasks/task-1/outputs"): outputs})

    # Act
    result = CliRunner().invoke(cli.task, ["outputs", "task-1"], obj=hub.hub)

    # Assert: the spend, and a row per evaluator with the global model's column first
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "artifact art-1" in lines and any("dev-a" in line and "digits" in line and "1.234" in line for line in lines), result.output
    header = next(line for line in lines if "DATA OF (accuracy)" in line)
    assert header.index("global") < header.index("dev-a") < header.index("dev-b"), header
    row = next(line for line in lines if line.lstrip("│ ").startswith("dev-b") and "0.8800" in line)
    assert row.index("0.8800") < row.index("0.6100") < row.index("0.9300"), row


def test_outputs_print_each_check_of_the_global_model_and_which_round_was_published() -> None:
    from interfaces.tasks import RoundScore

    outputs = TaskOutputs(
        task_id="task-1", state=TaskState.SUCCEEDED, complete=True, items_total=None, items_done=None, artifacts=["art-9"], best_round=4,
        rounds_scored=[RoundScore(round=2, metric="accuracy", value=0.8125, evaluators=3, artifact_id="art-3"),
                       RoundScore(round=4, metric="accuracy", value=0.9375, evaluators=3, artifact_id="art-5"),
                       RoundScore(round=6, metric="accuracy", value=None, evaluators=0, artifact_id="art-7")],
    ).model_dump(mode="json")  # fmt: skip
    hub = ScriptedHub({("GET", "/tasks/task-1/outputs"): outputs})

    result = CliRunner().invoke(cli.task, ["outputs", "task-1"], obj=hub.hub)

    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("4 (published)" in line and "0.9375" in line and "art-5" in line for line in lines), result.output
    assert any(line.lstrip("│ ").startswith("2 ") and "0.8125" in line for line in lines), result.output
    assert not any("2 (published)" in line or "6 (published)" in line for line in lines), result.output


def test_outputs_of_a_training_task_name_the_published_model_its_lineage_and_download_it(tmp_path: Path) -> None:
    # Prepare: an incremental training task that published digits 1.0.1, trained from 1.0.0
    model = b"onnx bytes of digits 1.0.1"
    outputs = TaskOutputs(task_id="task-1", state=TaskState.SUCCEEDED, complete=True, items_total=None, items_done=None, artifacts=["art-9"]).model_dump(mode="json")
    artifact = {"id": "art-9", "kind": "model", "name": "digits", "version": "1.0.1", "format": "onnx", "size": len(model), "sha256": hashlib.sha256(model).hexdigest()}
    hub = ScriptedHub({
        ("GET", "/tasks/task-1/outputs"): outputs, ("GET", "/tasks/task-1"): {**_task(TaskState.SUCCEEDED), "spec": {"model": {"name": "digits", "version": "1.0.0"}}},
        ("GET", "/artifacts/art-9"): artifact, ("GET", "/artifacts/art-9/content"): httpx.Response(200, content=model),
    })  # fmt: skip

    # Act
    shown = CliRunner().invoke(cli.task, ["outputs", "task-1"], obj=hub.hub)
    fetched = CliRunner().invoke(cli.task, ["outputs", "task-1", "--out", str(tmp_path / "m.onnx")], obj=hub.hub)

    # Assert: no --json needed for what was published and from what; --out downloads the model (no 409)
    assert shown.exit_code == 0, shown.output
    assert "artifact art-9: published model digits 1.0.1 (onnx)" in shown.output and "trained from digits 1.0.0" in shown.output
    assert fetched.exit_code == 0, fetched.output
    assert (tmp_path / "m.onnx").read_bytes() == model and "digits 1.0.1" in fetched.output
