"""Task workers on a device (DESIGN §4.3): a real WorkerHost over a real ModelHost running the test MLP, the
events it emits validated with the interfaces models; the desired document's task orders; and one run
through the real Device agent and Mosquitto."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel
from safetensors.numpy import load as load_frame
from safetensors.numpy import save_file

from cloud.signing import SigningKey
from device.desired import NONE, DesiredStore
from device.ota.download import Downloader
from device.ota.models import ModelHost, model_commands
from device.tasks import InputFetcher, WorkerHost
from interfaces.deployments import ArtifactFormat, ArtifactKind, ArtifactManifest
from interfaces.ids import new_id
from interfaces.messages import DesiredBody, envelope
from interfaces.tasks import (
    TASK_LOG_EVENT,
    TASK_METRICS_EVENT,
    TASK_OUTPUT_EVENT,
    TASK_WORKER_EVENT,
    InputRef,
    TaskType,
    WorkerAction,
    WorkerLog,
    WorkerMetrics,
    WorkerOrder,
    WorkerOutput,
    WorkerReport,
    worker_order,
)  # fmt: skip
from tests.device.ota_support import TOKEN, V1, BlobServer, blob_server, make_order

MODEL = Path(__file__).parent.parent / "fixtures" / "models" / "mlp-1.0.0.onnx"
MODELS: dict[str, type[BaseModel]] = {
    TASK_WORKER_EVENT: WorkerReport, TASK_LOG_EVENT: WorkerLog, TASK_METRICS_EVENT: WorkerMetrics, TASK_OUTPUT_EVENT: WorkerOutput,
}  # fmt: skip


# ---- helpers ----------------------------------------------------------------------------------------
class Events:
    """The emit callable: records every event, validated with its interfaces model."""

    def __init__(self, output_delay_s: float = 0.0) -> None:
        self.items: list[tuple[str, Any, str]] = []
        self.output_delay_s = output_delay_s
        self._cond = threading.Condition()

    def __call__(self, type: str, data: dict[str, Any], severity: str) -> None:
        model = MODELS[type].model_validate(json.loads(json.dumps(data)))  # what arrives after the wire
        if type == TASK_OUTPUT_EVENT and self.output_delay_s:
            time.sleep(self.output_delay_s)
        with self._cond:
            self.items.append((type, model, severity))
            self._cond.notify_all()

    def of(self, type: str, worker_id: str | None = None) -> list[Any]:
        with self._cond:
            return [m for t, m, _ in self.items if t == type and (worker_id is None or m.worker_id == worker_id)]

    def reports(self, worker_id: str) -> list[WorkerReport]:
        return self.of(TASK_WORKER_EVENT, worker_id)

    def outputs(self, worker_id: str) -> list[WorkerOutput]:
        return self.of(TASK_OUTPUT_EVENT, worker_id)

    def lines(self, worker_id: str) -> list[str]:
        return [line.text for batch in self.of(TASK_LOG_EVENT, worker_id) for line in batch.lines]

    def wait(self, check: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (result := check()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what or check}: {[(t, m) for t, m, _ in self.items][-10:]}")
                self._cond.wait(min(left, 0.05))
            return result

    def final(self, worker_id: str, timeout: float = 60.0) -> WorkerReport:
        return self.wait(lambda: next((r for r in self.reports(worker_id) if r.state != "RUNNING"), None), timeout, f"final report of {worker_id}")


@pytest.fixture
def models(tmp_path: Path) -> ModelHost:
    host = ModelHost(tmp_path / "models")
    sha = hashlib.sha256(MODEL.read_bytes()).hexdigest()
    host.activate(host.load("classifier", "1.0.0", sha, ArtifactFormat.ONNX, MODEL))
    return host


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return SigningKey.load_or_create(tmp_path_factory.mktemp("hub-pki"))


def dataset(tmp_path: Path, rows: int, fmt: ArtifactFormat = ArtifactFormat.NPY, columns: int = 128, tensors: dict[str, np.ndarray] | None = None) -> tuple[Path, np.ndarray]:
    """A dataset file of ``rows`` random inputs (and, for safetensors, any extra ``tensors``)."""
    x = np.random.default_rng(rows).standard_normal((rows, columns)).astype(np.float32)
    path = tmp_path / f"data-{new_id('f')}.{fmt.value}"
    if fmt is ArtifactFormat.NPY:
        np.save(path, x)
    else:
        save_file({"x": x, **(tensors or {})}, str(path))
    return path, x


def input_ref(signing: SigningKey, path: Path, fmt: ArtifactFormat) -> InputRef:
    data = path.read_bytes()
    manifest = ArtifactManifest(
        name="inputs", version="1.0.0", kind=ArtifactKind.DATASET, format=fmt, sha256=hashlib.sha256(data).hexdigest(),
        size=len(data), created_at=datetime.now(UTC),
    )  # fmt: skip
    artifact_id = f"art-{manifest.sha256[:12]}"
    return InputRef(artifact_id=artifact_id, signed_manifest=signing.sign_manifest(manifest), path=f"/artifacts/{artifact_id}/content", token=TOKEN)


def batch_order(
    ref: InputRef, items: int, chunk_size: int, chunks: list[tuple[int, int]], *, worker_id: str | None = None, **spec: Any
) -> WorkerOrder:
    spec = {"model": {"name": "classifier"}, "inputs": ref.artifact_id, "chunk_size": chunk_size, **spec}
    return worker_order(
        worker_id=worker_id or new_id("wk"), task_id="tk-batch", type=TaskType.BATCH_INFERENCE, spec=spec, heartbeat_s=0.2,
        inputs=ref, items=items, chunk_size=chunk_size, chunks=chunks,
    )  # fmt: skip


def gathered(events: Events, worker_id: str) -> dict[int, dict[str, np.ndarray]]:
    """Each chunk's decoded outputs; a chunk sent twice fails the test."""
    chunks: dict[int, dict[str, np.ndarray]] = {}
    for output in events.outputs(worker_id):
        assert output.chunk not in chunks, f"chunk {output.chunk} sent twice"
        chunks[output.chunk] = load_frame(base64.b64decode(output.data))
        assert next(iter(chunks[output.chunk].values())).shape[0] == output.items
    return chunks


def expected(models: ModelHost, x: np.ndarray) -> np.ndarray:
    return models.infer({"x": x}, "classifier").outputs["probabilities"]


@pytest.fixture
def hosts() -> Iterator[list[WorkerHost]]:
    made: list[WorkerHost] = []
    yield made
    for host in made:
        host.stop(2.0)


@pytest.fixture
def make_host(tmp_path: Path, models: ModelHost, hosts: list[WorkerHost]) -> Callable[..., tuple[WorkerHost, Events]]:
    def make(fetch: Callable[[InputRef], Path] | None = None, events: Events | None = None, data_dir: Path | None = None) -> tuple[WorkerHost, Events]:
        events = events or Events()
        host = WorkerHost(data_dir or tmp_path / "tasks", models, events, fetch or (lambda ref: pytest.fail("no inputs expected")))
        hosts.append(host)
        return host, events

    return make


# ---- batch inference ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [ArtifactFormat.NPY, ArtifactFormat.SAFETENSORS])
def test_batch_outputs_of_every_chunk_equal_the_model_run_directly(
    tmp_path: Path, models: ModelHost, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]], fmt: ArtifactFormat
) -> None:
    # Prepare: 200 rows in chunks of 32 (the last one short); a safetensors file with a second tensor
    extra = {"labels": np.arange(200, dtype=np.int64)} if fmt is ArtifactFormat.SAFETENSORS else None
    path, x = dataset(tmp_path, 200, fmt, tensors=extra)
    ref = input_ref(signing, path, fmt)
    host, events = make_host(lambda r: path)
    spec = {"input_name": "x"} if fmt is ArtifactFormat.SAFETENSORS else {}
    order = batch_order(ref, 200, 32, [(0, 7)], **spec)

    # Execute
    host.apply([order])
    events.wait(lambda: len(events.outputs(order.worker_id)) == 7, what="7 chunks")
    events.wait(lambda: any(r.items_done == 200 for r in events.reports(order.worker_id)), what="a heartbeat after the last chunk")
    events.wait(lambda: any(m.values.get("chunks_done") == 7 for m in events.of(TASK_METRICS_EVENT, order.worker_id)), what="metrics")
    events.wait(lambda: any(t.startswith("done:") for t in events.lines(order.worker_id)), what="the done line")

    # Assert: every row's outputs, in order, as the model computes them; the worker stays RUNNING
    chunks = gathered(events, order.worker_id)
    assert sorted(chunks) == list(range(7))
    assert [o.items for o in events.outputs(order.worker_id)] == [32] * 6 + [8]
    got = np.concatenate([chunks[i]["probabilities"] for i in range(7)])
    np.testing.assert_allclose(got, expected(models, x), rtol=1e-5, atol=1e-7)
    assert {r.state for r in events.reports(order.worker_id)} == {"RUNNING"}
    assert [w.state for w in host.workers()] == ["RUNNING"]
    sample = [m for m in events.of(TASK_METRICS_EVENT, order.worker_id) if m.values.get("chunks_done") == 7][0].values
    assert sample["items_done"] == 200 and sample["chunk_ms"] > 0 and "items_per_s" in sample
    lines = events.lines(order.worker_id)
    assert lines[0].startswith("model classifier 1.0.0 loaded")
    assert any(line.startswith(f"inputs {ref.artifact_id}: 200 rows of shape [128] float32") for line in lines)
    assert "chunk 6: rows 192–199" in [line.split(",")[0] for line in lines]
    assert lines[-1].startswith("done: 7 chunks, 200 inputs")


def test_log_lines_arrive_in_order_in_batches(
    tmp_path: Path, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    # Prepare: 130 one-row chunks, so 130 chunk lines and more
    path, _ = dataset(tmp_path, 130)
    host, events = make_host(lambda r: path)
    order = batch_order(input_ref(signing, path, ArtifactFormat.NPY), 130, 1, [(0, 130)])

    # Execute
    host.apply([order])
    events.wait(lambda: any(t.startswith("done:") for t in events.lines(order.worker_id)), what="the done line")

    # Assert
    chunk_lines = [t for t in events.lines(order.worker_id) if t.startswith("chunk ")]
    assert [int(t.split(":")[0].split()[1]) for t in chunk_lines] == list(range(130))
    batches = events.of(TASK_LOG_EVENT, order.worker_id)
    assert len(batches) >= 3 and all(len(b.lines) <= 50 for b in batches)
    stamps = [line.ts for b in batches for line in b.lines]
    assert stamps == sorted(stamps)


def test_pause_holds_the_worker_between_chunks_and_more_chunks_run_once(
    tmp_path: Path, models: ModelHost, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    # Prepare: a worker that owns chunks 0-1 of 8 and has done them
    path, x = dataset(tmp_path, 64)
    ref = input_ref(signing, path, ArtifactFormat.NPY)
    host, events = make_host(lambda r: path)
    order = batch_order(ref, 64, 8, [(0, 2)])
    host.apply([order])
    events.wait(lambda: any(t.startswith("done: 2 chunks") for t in events.lines(order.worker_id)), what="chunks 0-1")

    # Execute: paused while it gains chunks 4-5; then resumed; then it gains 2-3 and 6-7 in one range
    paused = order.model_copy(update={"action": WorkerAction.PAUSE, "chunks": [(0, 2), (4, 6)]})
    host.apply([paused])
    events.wait(lambda: any(r.paused for r in events.reports(order.worker_id)), what="a paused heartbeat")
    beats = len(events.reports(order.worker_id))
    events.wait(lambda: len(events.reports(order.worker_id)) >= beats + 3, what="three more heartbeats while paused")
    outputs_while_paused = sorted(o.chunk for o in events.outputs(order.worker_id))
    later_beats = events.reports(order.worker_id)[beats:]
    host.apply([paused.model_copy(update={"action": WorkerAction.RUN})])
    events.wait(lambda: len(events.outputs(order.worker_id)) == 4, what="chunks 4-5")
    host.apply([order.model_copy(update={"chunks": [(0, 8)]})])
    events.wait(lambda: len(events.outputs(order.worker_id)) == 8, what="all 8 chunks")
    events.wait(lambda: any(t.startswith("done: 8 chunks") for t in events.lines(order.worker_id)), what="the done line after every chunk it computes")

    # Assert: nothing ran while paused, heartbeats went on saying so; each chunk was computed once
    assert outputs_while_paused == [0, 1]
    assert len(later_beats) >= 2 and all(r.paused and r.state == "RUNNING" for r in later_beats)
    assert [o.chunk for o in events.outputs(order.worker_id)] == [0, 1, 4, 5, 2, 3, 6, 7]
    chunks = gathered(events, order.worker_id)
    got = np.concatenate([chunks[i]["probabilities"] for i in range(8)])
    np.testing.assert_allclose(got, expected(models, x), rtol=1e-5, atol=1e-7)
    assert not events.reports(order.worker_id)[-1].paused
    assert "paused" in events.lines(order.worker_id) and "resumed" in events.lines(order.worker_id)


def test_a_worker_that_starts_paused_processes_nothing_until_run(
    tmp_path: Path, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    path, _ = dataset(tmp_path, 16)
    host, events = make_host(lambda r: path)
    order = batch_order(input_ref(signing, path, ArtifactFormat.NPY), 16, 8, [(0, 2)]).model_copy(update={"action": WorkerAction.PAUSE})

    host.apply([order])
    events.wait(lambda: len([r for r in events.reports(order.worker_id) if r.paused]) >= 2, what="paused heartbeats")
    assert events.outputs(order.worker_id) == []
    host.apply([order.model_copy(update={"action": WorkerAction.RUN})])
    events.wait(lambda: len(events.outputs(order.worker_id)) == 2, what="both chunks")


def test_a_withdrawn_worker_finishes_the_chunk_in_hand_and_ends_without_a_report(
    tmp_path: Path, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    # Prepare: sending each output takes 50 ms, so 100 chunks take 5 s
    path, _ = dataset(tmp_path, 100)
    host, events = make_host(lambda r: path, Events(output_delay_s=0.05))
    order = batch_order(input_ref(signing, path, ArtifactFormat.NPY), 100, 1, [(0, 100)])
    host.apply([order])
    events.wait(lambda: len(events.outputs(order.worker_id)) >= 2, what="two chunks")

    # Execute
    (thread,) = [t for t in threading.enumerate() if t.name == f"aisynergy-task-{order.worker_id}"]
    host.apply([])
    thread.join(60)  # it finishes the chunk in hand, then ends
    assert not thread.is_alive()
    count = len(events.outputs(order.worker_id))
    reports = len(events.reports(order.worker_id))
    time.sleep(0.6)  # a window showing absence: no heartbeat from the host's ticker after the worker ended; an ended worker has no later event to wait for

    # Assert: it stopped, sent nothing more (no heartbeats, no final report) and is gone
    assert count < 100 and len(events.outputs(order.worker_id)) == count
    assert len(events.reports(order.worker_id)) == reports
    assert {r.state for r in events.reports(order.worker_id)} == {"RUNNING"}
    assert host.workers() == []


def test_a_model_that_is_not_loaded_is_rejected_naming_what_is(
    tmp_path: Path, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    path, _ = dataset(tmp_path, 8)
    host, events = make_host(lambda r: path)
    ref = input_ref(signing, path, ArtifactFormat.NPY)
    other = batch_order(ref, 8, 8, [(0, 1)], model={"name": "detector"})
    old = batch_order(ref, 8, 8, [(0, 1)], model={"name": "classifier", "version": "0.9.0"})

    host.apply([other, old])

    for order, wanted in ((other, "detector"), (old, "classifier 0.9.0")):
        final = events.final(order.worker_id)
        assert final.state == "REJECTED"
        assert f"model {wanted} is not loaded" in final.detail and "loaded: classifier 1.0.0" in final.detail
        assert [r.state for r in events.reports(order.worker_id)] == ["REJECTED"]


def test_an_unknown_input_name_is_rejected(tmp_path: Path, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]]) -> None:
    path, _ = dataset(tmp_path, 8)
    host, events = make_host(lambda r: path)
    order = batch_order(input_ref(signing, path, ArtifactFormat.NPY), 8, 8, [(0, 1)], input_name="image")

    host.apply([order])

    final = events.final(order.worker_id)
    assert final.state == "REJECTED" and "no input 'image'" in final.detail and "'x'" in final.detail


def test_the_safetensors_tensor_read_is_the_named_one_the_only_one_or_the_model_inputs(
    tmp_path: Path, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    # Prepare: files with tensors {x, y}, {data} and {a, b}
    rows = np.ones((8, 128), np.float32)
    files = {"xy": {"x": rows, "y": np.zeros((8, 2), np.float32)}, "only": {"data": rows}, "ab": {"a": rows, "b": rows}}
    refs = {}
    for name, tensors in files.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        refs[name] = input_ref(signing, tmp_path / f"{name}.safetensors", ArtifactFormat.SAFETENSORS)
    by_sha = {ref.signed_manifest.manifest.sha256: tmp_path / f"{name}.safetensors" for name, ref in refs.items()}
    host, events = make_host(lambda r: by_sha[r.signed_manifest.manifest.sha256])
    model_input = batch_order(refs["xy"], 8, 8, [(0, 1)])
    only = batch_order(refs["only"], 8, 8, [(0, 1)])
    named_missing = batch_order(refs["only"], 8, 8, [(0, 1)], input_name="x")
    ambiguous = batch_order(refs["ab"], 8, 8, [(0, 1)])

    # Execute
    host.apply([model_input, only, named_missing, ambiguous])

    # Assert
    for order in (model_input, only):
        events.wait(lambda o=order: len(events.outputs(o.worker_id)) == 1, what=f"the chunk of {order.worker_id}")
    missing = events.final(named_missing.worker_id)
    assert missing.state == "REJECTED" and "no tensor 'x'" in missing.detail and "['data']" in missing.detail
    several = events.final(ambiguous.worker_id)
    assert several.state == "REJECTED" and "several tensors" in several.detail and "input_name" in several.detail


def test_outputs_too_big_for_one_message_fail_the_worker(
    tmp_path: Path, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    # Prepare: 6000 rows x 10 float32 outputs = 240 000 bytes in one chunk
    path, _ = dataset(tmp_path, 6000)
    host, events = make_host(lambda r: path)
    order = batch_order(input_ref(signing, path, ArtifactFormat.NPY), 6000, 6000, [(0, 1)])

    host.apply([order])

    final = events.final(order.worker_id)
    assert final.state == "FAILED" and "lower chunk_size" in final.detail and "chunk 0" in final.detail
    assert events.outputs(order.worker_id) == []
    assert [r.state for r in events.reports(order.worker_id)][0] == "RUNNING"
    assert any(t.startswith("FAILED:") for t in events.lines(order.worker_id))


def test_inputs_that_do_not_fit_the_model_fail_with_the_runtime_message(
    tmp_path: Path, signing: SigningKey, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    path, _ = dataset(tmp_path, 16, columns=64)
    host, events = make_host(lambda r: path)
    order = batch_order(input_ref(signing, path, ArtifactFormat.NPY), 16, 8, [(0, 2)])

    host.apply([order])

    final = events.final(order.worker_id)
    assert final.state == "FAILED" and final.detail.startswith("chunk 0 (rows 0–7): ")
    assert "dimension" in final.detail.lower()  # ONNX Runtime's own words
    assert host.workers()[0].state == "FAILED"


def test_an_order_of_a_type_without_a_program_is_rejected(make_host: Callable[..., tuple[WorkerHost, Events]], monkeypatch: pytest.MonkeyPatch) -> None:
    # a target built without one of the programs (a board that ships no training, say)
    import device.tasks.programs as programs

    monkeypatch.delitem(programs.PROGRAMS, TaskType.FEDERATED_TRAINING)
    host, events = make_host()
    order = worker_order(worker_id="wk-fl", task_id="tk-fl", type=TaskType.FEDERATED_TRAINING, spec={"model": {"name": "classifier"}, "dataset": "camera", "rounds": 1})

    host.apply([order])

    final = events.final("wk-fl")
    assert final.state == "REJECTED" and final.detail == "this target has no worker program for type federated_training"


def test_a_finished_worker_is_reported_again_after_a_restart_not_run_again(
    tmp_path: Path, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    # Prepare: a worker REJECTED, then the host "restarts" on the same directory
    order = worker_order(worker_id="wk-once", task_id="tk-once", type=TaskType.SPLIT_INFERENCE, spec={"model": {"name": "classifier"}})
    first, events = make_host()
    first.apply([order])
    events.final("wk-once")
    first.stop()

    # Execute
    second, again = make_host()
    second.apply([order])
    second.apply([order])  # the same document again: nothing more
    repeated = again.reports("wk-once")  # sent again inside apply(), from the record
    run_again = second.workers()  # a run of the order would be a worker here as soon as apply() returns
    retried = order.model_copy(update={"attempt": 2})
    second.apply([retried])

    # Assert: the final report once more, no run; a higher attempt runs again
    assert [(r.state, r.detail) for r in repeated] == [("REJECTED", events.final("wk-once").detail)]
    assert run_again == []
    again.wait(lambda: len(again.reports("wk-once")) == 2, what="the second attempt's report")
    assert second.workers()[0].state == "REJECTED"


# ---- inference (serving) -------------------------------------------------------------------------------
def test_inference_counts_requests_made_through_the_model_host_and_succeeds_after_its_duration(
    models: ModelHost, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    # Prepare
    host, events = make_host()
    spec = {"model": {"name": "classifier", "version": "1.0.0"}, "duration_s": 1.5, "report_interval_s": 0.2}
    order = worker_order(worker_id="wk-serve", task_id="tk-serve", type=TaskType.INFERENCE, spec=spec, heartbeat_s=0.3)
    infer = model_commands(models)["infer"]
    x = np.zeros((4, 128), dtype=np.float32)

    # Execute: 20 requests through ModelHost.infer, 5 through the infer command, 2 that fail
    host.apply([order])
    events.wait(lambda: events.reports("wk-serve"), what="RUNNING")
    started = time.monotonic()
    for _ in range(20):
        models.infer({"x": x})
    for _ in range(5):
        infer({"inputs": {"x": x[:1].tolist()}})
    for _ in range(2):
        with pytest.raises(ValueError):
            models.infer({"wrong": x})
    final = events.final("wk-serve", timeout=60)
    took = time.monotonic() - started

    # Assert
    assert final.state == "SUCCEEDED" and took < 2.5
    samples = [m.values for m in events.of(TASK_METRICS_EVENT, "wk-serve")]
    assert len(samples) >= 3
    assert samples[-1]["requests"] == 27 and samples[-1]["errors"] == 2
    assert sum(s["requests_per_s"] for s in samples) > 0
    with_latency = [s for s in samples if "latency_p50_ms" in s]
    assert with_latency and all(0 < s["latency_p50_ms"] <= s["latency_p99_ms"] for s in with_latency)
    assert [r.state for r in events.reports("wk-serve")][-1] == "SUCCEEDED"
    assert events.lines("wk-serve")[0] == "serving classifier 1.0.0 for 1.5 s"
    assert models._listeners == ()  # the worker stopped listening


def test_inference_of_a_model_that_is_not_loaded_is_rejected_and_a_withdrawn_one_stops(
    models: ModelHost, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    host, events = make_host()
    missing = worker_order(worker_id="wk-miss", task_id="tk-s", type=TaskType.INFERENCE, spec={"model": {"name": "nope"}})
    forever = worker_order(worker_id="wk-ever", task_id="tk-s", type=TaskType.INFERENCE, spec={"model": {"name": "classifier"}}, heartbeat_s=0.2)

    host.apply([missing, forever])
    assert events.final("wk-miss").state == "REJECTED"
    events.wait(lambda: len(events.reports("wk-ever")) >= 2, what="heartbeats")
    (thread,) = [t for t in threading.enumerate() if t.name == "aisynergy-task-wk-ever"]
    host.apply([missing])
    events.wait(lambda: models._listeners == (), what="the worker's end")
    thread.join(30)  # a final report would have left by now
    assert not thread.is_alive(), "the withdrawn worker's thread did not end"
    count = len(events.reports("wk-ever"))
    time.sleep(0.5)  # a window showing absence: no heartbeat from the host's ticker after the worker ended; an ended worker has no later event to wait for

    assert len(events.reports("wk-ever")) == count
    assert {r.state for r in events.reports("wk-ever")} == {"RUNNING"}
    assert [w.worker_id for w in host.workers()] == ["wk-miss"]


# ---- inputs fetched like artefacts ------------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[BlobServer]:
    with blob_server() as s:
        yield s


def test_inputs_are_downloaded_verified_and_kept_and_a_bad_signature_is_rejected(
    tmp_path: Path, models: ModelHost, signing: SigningKey, server: BlobServer, make_host: Callable[..., tuple[WorkerHost, Events]]
) -> None:
    # Prepare: the dataset served like an artefact; a second reference signed by another key
    path, x = dataset(tmp_path, 40)
    ref = input_ref(signing, path, ArtifactFormat.NPY)
    server.blobs[ref.path] = path.read_bytes()
    forger = SigningKey.load_or_create(tmp_path / "forger")
    forged = input_ref(forger, path, ArtifactFormat.NPY)
    downloader = Downloader(server.base_url, tmp_path / "partial", attempts=1)
    fetch = InputFetcher(tmp_path / "inputs", lambda: signing.public_key, lambda: downloader)
    host, events = make_host(fetch)
    good = batch_order(ref, 40, 16, [(0, 3)])
    bad = batch_order(forged, 40, 16, [(0, 3)])

    # Execute
    host.apply([good, bad])
    events.wait(lambda: len(events.outputs(good.worker_id)) == 3, what="three chunks")
    again = batch_order(ref, 40, 16, [(0, 3)])
    host.apply([good, bad, again])
    events.wait(lambda: len(events.outputs(again.worker_id)) == 3, what="three chunks again")

    # Assert
    kept = tmp_path / "inputs" / f"{ref.signed_manifest.manifest.sha256}.npy"
    assert kept.read_bytes() == path.read_bytes()
    assert server.paths() == [ref.path]  # the second worker used the kept file
    final = events.final(bad.worker_id)
    assert final.state == "REJECTED" and "bad signature" in final.detail
    got = np.concatenate([gathered(events, again.worker_id)[i]["probabilities"] for i in range(3)])
    np.testing.assert_allclose(got, expected(models, x), rtol=1e-5, atol=1e-7)
    host.apply([])
    assert not kept.exists()  # no order names it any more


# ---- the desired document ------------------------------------------------------------------------------
def test_the_desired_store_keeps_task_orders_and_reads_an_older_file(tmp_path: Path) -> None:
    # Prepare: a desired.json from before task orders existed
    old = {"version": 3, "spec": {"a": 1}, "message_id": "m-1", "applied_version": 3, "status": {"a": 1},
           "deployments": [], "deployments_version": 2, "applied_deployments_version": 2}  # fmt: skip
    (tmp_path / "desired.json").write_text(json.dumps(old))
    order = worker_order(worker_id="wk-1", task_id="tk-1", type=TaskType.INFERENCE, spec={"model": {"name": "classifier"}})

    # Execute
    store = DesiredStore(tmp_path / "desired.json")
    before = store.record
    fresh = store.offer(DesiredBody(version=3, deployments_version=2, tasks=[order], tasks_version=1))
    repeated = store.offer(DesiredBody(version=3, deployments_version=2, tasks=[order], tasks_version=1))
    pending = DesiredStore(tmp_path / "desired.json").record
    store.applied(3, {"a": 1})
    done = DesiredStore(tmp_path / "desired.json").record

    # Assert
    assert (before.tasks, before.tasks_version, before.applied_tasks_version, before.pending) == ([], NONE, NONE, False)
    assert fresh and not repeated
    assert pending.tasks == [order] and pending.tasks_version == 1 and pending.tasks_pending and pending.pending
    assert not pending.orders_pending and pending.version == pending.applied_version
    assert done.applied_tasks_version == 1 and not done.pending and done.tasks == [order]


# ---- through the real Device agent and broker -------------------------------------------------------------
@pytest.mark.broker
def test_a_task_order_in_the_desired_document_runs_on_the_device(
    tmp_path: Path, test_ca: Any, device_broker: Any, server: BlobServer, signing: SigningKey
) -> None:
    from device.agent import Device
    from device.identity import IdentityStore
    from interfaces.topics import DEVICE_DESIRED
    from tests.device.conftest import EdgeObserver

    # Prepare: a device with the hub key pinned; the model deployed and a batch task in the same document
    device_id, store = new_id("dv"), IdentityStore(tmp_path / "device")
    issued = test_ca.issue(store.make_csr(device_id), device_id, device_broker.url, heartbeat_s=1.0)
    store.save(issued.model_copy(update={"signing_key_pem": signing.public_pem}), server.url)
    edge = EdgeObserver(device_broker, device_id)
    path, x = dataset(tmp_path, 50)
    ref = input_ref(signing, path, ArtifactFormat.NPY)
    server.blobs[ref.path] = path.read_bytes()
    order = batch_order(ref, 50, 20, [(0, 3)])

    def desire(tasks_version: int, tasks: list[WorkerOrder]) -> None:
        body = DesiredBody(version=1, deployments=[make_order(signing, server, V1, "1.0.0")], deployments_version=1, tasks=tasks, tasks_version=tasks_version)
        edge.publish(DEVICE_DESIRED.topic(device_id=device_id), envelope("edge", body).model_dump_json().encode(), retain=True)

    def task_events(type: str) -> list[dict[str, Any]]:
        return [b["data"] for b in edge.bodies("events") if b["type"] == type and b["data"]["worker_id"] == order.worker_id]

    def wait(check: Callable[[], Any], what: str) -> None:
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    try:
        with Device(device_id, store.data_dir) as dev:
            # Execute
            desire(1, [order])
            wait(lambda: len(task_events(TASK_OUTPUT_EVENT)) == 3, "three chunks on the broker")
            edge.expect("reported", timeout=60, version=1)
            wait(lambda: any(line["text"].startswith("done:") for d in task_events(TASK_LOG_EVENT) for line in d["lines"]), "the done line")
            desire(2, [])  # withdrawn
            wait(lambda: dev.tasks.workers() == [], "the worker withdrawn")
            wait(lambda: dev._desired.record.applied_tasks_version == 2, "tasks version 2 applied")
            beats = len(task_events(TASK_WORKER_EVENT))
            time.sleep(0.5)  # a window showing absence: no report of the withdrawn worker reaches the broker; a worker that is gone has no later event to wait for
            after = len(task_events(TASK_WORKER_EVENT))

        # Assert
        outputs = {d["chunk"]: load_frame(base64.b64decode(d["data"]))["probabilities"] for d in task_events(TASK_OUTPUT_EVENT)}
        np.testing.assert_allclose(np.concatenate([outputs[i] for i in range(3)]), expected(dev.models, x), rtol=1e-5, atol=1e-7)
        assert {d["state"] for d in task_events(TASK_WORKER_EVENT)} == {"RUNNING"}
        assert after == beats
        for type, model in MODELS.items():
            for data in task_events(type):
                model.model_validate(data)
    finally:
        edge.close()
