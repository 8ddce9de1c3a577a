"""Split inference in the hub (DESIGN §5): admission cuts the ONNX model into signed heads and tails, the
scheduler places a head on every device and one tail on every edge node under a head, tails follow their
heads, and the artefacts a split task sends stay while the task exists.

The scheduler is ticked by the test; devices and edge nodes report through the ingest as MQTT events relayed
by an edge would arrive. The cuts are checked against ``cloud.ml.partition.candidate_cuts`` and the parts
against the ONNX checker and ONNX Runtime, independently of the hub.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from sqlalchemy import select
from sqlmodel import Session

from cloud.artifacts import create_artifact, read_blob
from cloud.desired import DesiredPublisher
from cloud.ml.partition import candidate_cuts
from cloud.tables import Artifact, Node, SplitPartRow, SplitPlan, TaskWorker
from device.ota.verify import verify_manifest
from interfaces import tasks as contract
from interfaces.auth import Role
from interfaces.deployments import DOWNLOAD_TOKEN_HEADER, ArtifactCreate, SignedManifest
from interfaces.messages import ConnectionState, DesiredBody, Envelope, Health, HeartbeatBody, StateBody
from interfaces.tasks import MAX_SPLIT_CUTS, SPLIT_DEVICE_ONLY, SPLIT_EDGE_ONLY, SPLIT_HEAD, SPLIT_TAIL
from tests.hub.conftest import assert_problem
from tests.hub.tasks_support import TaskFleet, resources, running_task_fleet

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
CNN, MLP = "digits-cnn", "digits-mlp"


@pytest.fixture
def fleet(database_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(database_url, tmp_path)


@pytest.fixture
def sqlite_fleet(sqlite_url: str, tmp_path: Path) -> Iterator[TaskFleet]:
    yield from running_task_fleet(sqlite_url, tmp_path)


def later(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


# --- models, devices, tasks ------------------------------------------------------------------------


def fixture_model(name: str) -> bytes:
    return (MODELS / f"{name}.onnx").read_bytes()


def chain_model(length: int, elem_type: int = TensorProto.FLOAT) -> bytes:
    """``x`` -> ``length`` elementwise nodes -> ``y``: every intermediate tensor is a clean cut (``length - 1``)."""
    nodes, previous = [], "x"
    for i in range(length):
        out = f"t{i}" if i < length - 1 else "y"
        nodes.append(helper.make_node("Abs" if i % 2 else "Neg", [previous], [out]))
        previous = out
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", elem_type, ["N", 4])], [helper.make_tensor_value_info("y", elem_type, ["N", 4])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def upload(fleet: TaskFleet, name: str, data: bytes, version: str = "1.0.0", fmt: str = "onnx") -> Artifact:
    body = ArtifactCreate(kind="model", name=name, version=version, format=fmt)  # type: ignore[arg-type]
    with Session(fleet.engine, expire_on_commit=False) as session, fleet.blobs.writer() as writer:
        writer.write(data)
        return create_artifact(session, fleet.controller.signing, fleet.blobs, body, writer)


def running(fleet: TaskFleet, node: str, model: Artifact | None, version: str | None = None, online: bool = True) -> str:
    """A device under ``node`` that reports ``model`` installed (name, version, sha256, artefact id)."""
    if model is None:
        return fleet.device(node, installed=None, online=online)
    installed = {"model": {"name": model.name, "version": version or model.version, "sha256": model.sha256, "artifact_id": model.id}}
    return fleet.device(node, installed=installed, online=online)


def split_body(model: str, devices: list[str], version: str | None = None, retry: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    ref = {"name": model, **({"version": version} if version else {})}
    return {
        "type": "split_inference", "spec": {"model": ref, **spec}, "placement": {"ids": devices},
        "retry": retry or {"backoff_s": 0, "max_attempts": 3},
    }  # fmt: skip


def split(fleet: TaskFleet, model: str, devices: list[str], expect: int = 201, version: str | None = None,
          retry: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:  # fmt: skip
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=split_body(model, devices, version, retry, **spec))
    assert r.status_code == expect, r.text
    return r.json()  # type: ignore[no-any-return]


def plan(fleet: TaskFleet, task_id: str) -> tuple[SplitPlan | None, list[SplitPartRow]]:
    with Session(fleet.engine) as session:
        head = session.get(SplitPlan, task_id)
        parts = list(session.execute(select(SplitPartRow).where(SplitPartRow.task_id == task_id).order_by(SplitPartRow.position)).scalars())  # type: ignore[arg-type]
        session.expunge_all()
        return head, parts


def artefact(fleet: TaskFleet, artifact_id: str) -> Artifact:
    with Session(fleet.engine, expire_on_commit=False) as session:
        row = session.get(Artifact, artifact_id)
        assert row is not None, artifact_id
        session.expunge(row)
        return row


def artefact_count(fleet: TaskFleet) -> int:
    with Session(fleet.engine) as session:
        return len(session.execute(select(Artifact.id)).all())


def blob_files(fleet: TaskFleet) -> list[str]:
    root = fleet.blobs.root
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".tmp" not in p.relative_to(root).parts)


def input_shape(data: bytes) -> list[int]:
    return [d.dim_value for d in onnx.load_from_string(data).graph.input[0].type.tensor_type.shape.dim]


def checked_onnx(data: bytes) -> onnx.ModelProto:
    model = onnx.load_from_string(data)
    onnx.checker.check_model(model, full_check=True)
    return model


def by_role(fleet: TaskFleet, task_id: str, only_active: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The task's workers (QUEUED or RUNNING ones only: ``only_active``) as heads and tails."""
    out: dict[str, list[dict[str, Any]]] = {SPLIT_HEAD: [], SPLIT_TAIL: []}
    for w in fleet.workers(task_id):
        if not only_active or w["state"] in ("QUEUED", "RUNNING"):
            out[w["role"]].append(w)
    return out


def active(fleet: TaskFleet, task_id: str) -> dict[str, list[dict[str, Any]]]:
    return by_role(fleet, task_id, only_active=True)


def node_orders(fleet: TaskFleet, node_id: str) -> list[contract.WorkerOrder]:
    return fleet.orders(node_id, Node)


def order_for(fleet: TaskFleet, worker: dict[str, Any]) -> contract.WorkerOrder:
    orders = node_orders(fleet, worker["target_id"]) if worker["target_kind"] == "node" else fleet.orders(worker["target_id"])
    (order,) = [o for o in orders if o.worker_id == worker["id"]]
    return order


def set_node(fleet: TaskFleet, node_id: str, state: ConnectionState) -> None:
    fleet.ingest.offer(node_id, StateBody(state=state, reason="will" if state is ConnectionState.OFFLINE else ""))
    fleet.ingest.flush()


def check_ref(fleet: TaskFleet, ref: contract.InputRef | None, artifact_id: str, target_id: str) -> bytes:
    """The ref names ``artifact_id`` with a manifest the hub's key signed, and its token lets ``target_id`` (and
    only for that artefact) fetch the bytes; returns them, fetched as the target would."""
    assert ref is not None
    stored = artefact(fleet, artifact_id)
    assert ref.artifact_id == artifact_id and ref.path == f"/artifacts/{artifact_id}/content"
    verify_manifest(fleet.controller.signing.public_key, ref.signed_manifest)
    manifest = ref.signed_manifest.manifest
    assert (manifest.kind, manifest.format, manifest.name, manifest.version, manifest.sha256, manifest.size) == (
        "model", "onnx", stored.name, stored.version, stored.sha256, stored.size,
    )  # fmt: skip
    grant = fleet.controller.signing.verify_download_token(ref.token, artifact_id)
    assert (grant.target_id, grant.sha256) == (target_id, stored.sha256)
    r = fleet.hub.request("GET", ref.path, None, headers={DOWNLOAD_TOKEN_HEADER: ref.token})
    assert r.status_code == 200, r.text
    return r.content


# --- admission -------------------------------------------------------------------------------------


def test_a_split_task_cuts_the_model_at_its_candidate_cuts_into_signed_heads_and_tails(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    # Prepare: the CNN uploaded, two devices reporting it installed
    gw = fleet.node()
    model = upload(fleet, CNN, fixture_model(CNN))
    devices = [running(fleet, gw, model), running(fleet, gw, model)]
    candidates = candidate_cuts(onnx.load_from_string(fixture_model(CNN)))
    assert 2 <= len(candidates) <= MAX_SPLIT_CUTS  # every candidate is a cut by default

    # Execute: a task naming the model without a version
    task = split(fleet, CNN, devices)

    # Assert: the version the devices run is pinned; one part per candidate cut, in the model's order
    assert task["state"] == "PENDING" and task["type"] == "split_inference"
    assert task["spec"]["model"] == {"name": CNN, "version": "1.0.0"}
    assert fleet.task(task["id"])["spec"]["model"] == {"name": CNN, "version": "1.0.0"}
    stored, parts = plan(fleet, task["id"])
    assert stored is not None and (stored.model_artifact_id, stored.input) == (model.id, "x")
    assert [(p.position, p.cut) for p in parts] == list(enumerate(candidates, start=1))
    x = np.random.default_rng(0).random((3, *input_shape(fixture_model(CNN))[1:]), dtype=np.float32)
    whole = ort.InferenceSession(fixture_model(CNN)).run(None, {"x": x})[0]
    for k, part in enumerate(parts, start=1):
        head_row, tail_row = artefact(fleet, part.head_artifact_id), artefact(fleet, part.tail_artifact_id)
        assert (head_row.kind, head_row.format, head_row.name, head_row.version) == ("model", "onnx", f"{CNN}.split{k}.head", "1.0.0")
        assert (tail_row.kind, tail_row.format, tail_row.name, tail_row.version) == ("model", "onnx", f"{CNN}.split{k}.tail", "1.0.0")
        head_bytes, tail_bytes = read_blob(fleet.blobs, head_row.sha256), read_blob(fleet.blobs, tail_row.sha256)
        head, tail = checked_onnx(head_bytes), checked_onnx(tail_bytes)
        assert [i.name for i in head.graph.input] == ["x"] and [o.name for o in head.graph.output] == [part.cut]
        assert [i.name for i in tail.graph.input] == [part.cut] and [o.name for o in tail.graph.output] == ["logits"]
        # the head then the tail computes what the whole model does
        activation = ort.InferenceSession(head_bytes).run(None, {"x": x})[0]
        np.testing.assert_allclose(ort.InferenceSession(tail_bytes).run(None, {part.cut: activation})[0], whole, rtol=1e-4, atol=1e-5)
        for row in (head_row, tail_row):  # what the API shows of each part is signed by the hub's key
            shown = fleet.hub.get(f"/artifacts/{row.id}").json()
            verify_manifest(fleet.controller.signing.public_key, SignedManifest.model_validate(shown["signed_manifest"]))


def test_a_deep_model_is_cut_at_most_max_split_cuts_times_spread_over_its_depth(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    data = chain_model(3 * MAX_SPLIT_CUTS)
    model = upload(fleet, "chain", data)
    device = running(fleet, gw, model)
    candidates = candidate_cuts(onnx.load_from_string(data))
    assert len(candidates) == 3 * MAX_SPLIT_CUTS - 1

    task = split(fleet, "chain", [device])

    _, parts = plan(fleet, task["id"])
    cuts = [p.cut for p in parts]
    assert len(cuts) == MAX_SPLIT_CUTS and cuts[0] == candidates[0] and cuts[-1] == candidates[-1]
    places = [candidates.index(c) for c in cuts]
    assert places == sorted(set(places))  # in the model's order, no repeats
    gaps = [b - a for a, b in itertools.pairwise(places)]
    assert max(gaps) - min(gaps) <= 1, gaps  # evenly spread
    for part in parts:
        assert artefact(fleet, part.head_artifact_id).name == f"chain.split{candidates.index(part.cut) + 1}.head"
        checked_onnx(read_blob(fleet.blobs, artefact(fleet, part.tail_artifact_id).sha256))


def test_given_cuts_are_kept_in_model_order_and_a_pinned_cut_makes_one_part_or_none(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload(fleet, CNN, fixture_model(CNN))
    device = running(fleet, gw, model)
    candidates = candidate_cuts(onnx.load_from_string(fixture_model(CNN)))
    late, early = candidates[-2], candidates[1]

    # cuts, given out of order: exactly those, in the model's order, named by their place among the candidates
    chosen = split(fleet, CNN, [device], cuts=[late, early])
    _, parts = plan(fleet, chosen["id"])
    assert [(p.position, p.cut) for p in parts] == [(1, early), (2, late)]
    assert [artefact(fleet, p.head_artifact_id).name for p in parts] == [f"{CNN}.split2.head", f"{CNN}.split{len(candidates) - 1}.head"]
    assert chosen["spec"]["cuts"] == [late, early]  # the spec is kept as given

    # a pinned tensor: one part; the same cut of the same model is the same stored artefact
    pinned = split(fleet, CNN, [device], cut=early)
    _, (only,) = plan(fleet, pinned["id"])
    assert (only.position, only.cut, only.head_artifact_id, only.tail_artifact_id) == (1, early, parts[0].head_artifact_id, parts[0].tail_artifact_id)

    # device-only and edge-only: a plan, no part
    for where in (SPLIT_DEVICE_ONLY, SPLIT_EDGE_ONLY):
        task = split(fleet, CNN, [device], cut=where)
        stored, none = plan(fleet, task["id"])
        assert stored is not None and stored.model_artifact_id == model.id and none == []
        assert task["spec"]["cut"] == where


# --- refusals ---------------------------------------------------------------------------------------


def test_what_cannot_be_split_is_refused_and_nothing_is_stored(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    # Prepare: a device running the CNN 1.0.0, one reporting 1.1.0, one running nothing; a TFLite model; an ONNX model taking int64
    gw = fleet.node()
    model = upload(fleet, CNN, fixture_model(CNN))
    ok = running(fleet, gw, model)
    other_version = running(fleet, gw, model, version="1.1.0")
    bare = running(fleet, gw, None)
    lite = upload(fleet, "digits-lite", (MODELS / f"{MLP}.tflite").read_bytes(), fmt="tflite")
    ints = upload(fleet, "ints", chain_model(3, TensorProto.INT64))
    candidates = candidate_cuts(onnx.load_from_string(fixture_model(CNN)))
    cases: list[tuple[dict[str, Any], str]] = [
        (split_body(CNN, [ok], cut="nope"), "'nope' is not a clean cut"),
        (split_body(CNN, [ok], cut="logits"), "'logits' is not a clean cut"),  # a graph output
        (split_body(CNN, [ok], cuts=[candidates[0], "nope"]), "not clean cuts: 'nope'"),
        (split_body("ghost", [ok], version="1.0.0"), "ghost 1.0.0 is not an artefact of this hub"),
        (split_body(CNN, [ok], version="9.9.9"), "not an artefact of this hub"),
        (split_body("digits-lite", [ok], version="1.0.0"), "split inference cuts ONNX models"),
        (split_body("ints", [ok], version="1.0.0"), "one float32 input"),
        (split_body(CNN, [ok, other_version]), "the devices run 1.0.0, 1.1.0"),
        (split_body(CNN, [bare]), "no device of the placement runs it"),
        (split_body(CNN, [ok], cut=candidates[0], cuts=[candidates[1]]), "not both"),
        (split_body(CNN, [ok], cuts=[candidates[0], candidates[0]]), "must not repeat"),
        (split_body(CNN, [ok], cuts=[SPLIT_EDGE_ONLY]), "device-only and edge-only are always options"),
        ({**split_body(CNN, [ok]), "placement": {"target": "node"}}, "does not run on nodes"),
    ]
    assert lite.format == "tflite" and ints.format == "onnx"
    before, blobs, count = fleet.hub.snapshot(), blob_files(fleet), artefact_count(fleet)

    for body, text in cases:
        # Execute
        r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=body)
        # Assert: 422 naming why; no task, no plan, no artefact, no blob
        problem = assert_problem(r, 422, "validation_failed")
        assert text in r.text, (body, problem)
        assert artefact_count(fleet) == count and blob_files(fleet) == blobs, body
    assert fleet.hub.snapshot() == before
    # an unknown cut names the model's candidates
    r = fleet.hub.request("POST", "/tasks", Role.OPERATOR, json=split_body(CNN, [ok], cut="nope"))
    detail = r.json()["detail"]
    assert f"candidate cuts of {CNN} 1.0.0 are: {', '.join(candidates)}" in detail
    assert fleet.hub.get("/tasks").json()["items"] == []


# --- scheduling -------------------------------------------------------------------------------------


def test_heads_go_to_the_devices_and_one_tail_to_each_edge_node_under_them(fleet: TaskFleet) -> None:
    # Prepare: gw_a with two devices running the model, gw_b with one, gw_c with one that does not run it, gw_d empty
    gw_a, gw_b, gw_c, gw_d = fleet.node("a"), fleet.node("b"), fleet.node("c"), fleet.node("d")
    model = upload(fleet, CNN, fixture_model(CNN))
    a1, a2, b1 = running(fleet, gw_a, model), running(fleet, gw_a, model), running(fleet, gw_b, model)
    c1 = running(fleet, gw_c, None)
    task = split(fleet, CNN, [a1, a2, b1, c1])
    _, parts = plan(fleet, task["id"])
    heads_of = [p.head_artifact_id for p in parts]
    tails_of = [p.tail_artifact_id for p in parts]

    # Execute
    fleet.tick()
    fleet.tick()  # a second tick places nothing more

    # Assert: a head on each device that runs the model, one tail per edge node under a head
    assert fleet.task(task["id"])["state"] == "SCHEDULED"
    workers = by_role(fleet, task["id"])
    assert sorted((w["target_kind"], w["target_id"]) for w in workers[SPLIT_HEAD]) == sorted(("device", d) for d in (a1, a2, b1))
    assert sorted((w["target_kind"], w["target_id"]) for w in workers[SPLIT_TAIL]) == sorted(("node", n) for n in (gw_a, gw_b))
    assert {w["state"] for ws in workers.values() for w in ws} == {"QUEUED"}
    assert fleet.orders(c1) == [] and node_orders(fleet, gw_c) == [] and node_orders(fleet, gw_d) == []
    for head in workers[SPLIT_HEAD]:
        order = order_for(fleet, head)
        assert (order.type, order.role, order.task_id, order.spec.model.model_dump()) == ("split_inference", SPLIT_HEAD, task["id"], {"name": CNN, "version": "1.0.0"})
        assert order.split is not None and order.split.base_sha256 == model.sha256 and order.split.input == "x" and order.split.whole is None
        assert [p.cut for p in order.split.parts] == [p.cut for p in parts]
        assert all(p.tail is None for p in order.split.parts)
        for part, artifact_id in zip(order.split.parts, heads_of, strict=True):
            checked_onnx(check_ref(fleet, part.head, artifact_id, head["target_id"]))
        assert [r.artifact_id for r in order.input_refs()] == heads_of
    for tail in workers[SPLIT_TAIL]:
        order = order_for(fleet, tail)
        assert order.role == SPLIT_TAIL and order.split is not None and order.split.base_sha256 == model.sha256
        assert [p.cut for p in order.split.parts] == [p.cut for p in parts] and all(p.head is None for p in order.split.parts)
        for part, artifact_id in zip(order.split.parts, tails_of, strict=True):
            checked_onnx(check_ref(fleet, part.tail, artifact_id, tail["target_id"]))
        assert check_ref(fleet, order.split.whole, model.id, tail["target_id"]) == fixture_model(CNN)
        assert [r.artifact_id for r in order.input_refs()] == [*tails_of, model.id]
    # the edge's desired document carries its tail's order
    pending = {p.row_id: p for p in DesiredPublisher(fleet.engine).pending()}
    doc = Envelope[DesiredBody].model_validate_json(pending[gw_b].payload)
    (order,) = doc.body.tasks
    assert order.role == SPLIT_TAIL and order.split is not None and [p.tail.artifact_id for p in order.split.parts] == tails_of  # type: ignore[union-attr]

    # the workers report; the task runs
    for w in [*workers[SPLIT_HEAD], *workers[SPLIT_TAIL]]:
        fleet.report(w, "RUNNING")
    assert fleet.task(task["id"])["state"] == "RUNNING"


def test_an_edge_only_task_sends_the_whole_model_to_the_tail_and_no_part(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload(fleet, MLP, fixture_model(MLP))
    device = running(fleet, gw, model)
    task = split(fleet, MLP, [device], cut=SPLIT_EDGE_ONLY)
    fleet.tick()
    workers = by_role(fleet, task["id"])
    (head,), (tail,) = workers[SPLIT_HEAD], workers[SPLIT_TAIL]
    head_order, tail_order = order_for(fleet, head), order_for(fleet, tail)
    assert head_order.split is not None and head_order.split.parts == [] and head_order.input_refs() == []
    assert head_order.split.base_sha256 == model.sha256 and head_order.spec.cut == SPLIT_EDGE_ONLY
    assert tail_order.split is not None and tail_order.split.parts == []
    assert check_ref(fleet, tail_order.split.whole, model.id, gw) == fixture_model(MLP)


# --- tails follow their heads -----------------------------------------------------------------------


def test_tails_end_with_their_heads_and_do_not_keep_the_task_alive(fleet: TaskFleet) -> None:
    # Prepare: gw_a with two devices, gw_b with one; a head is not tried again (max_attempts 1)
    gw_a, gw_b = fleet.node("a"), fleet.node("b")
    model = upload(fleet, MLP, fixture_model(MLP))
    a1, a2, b1 = running(fleet, gw_a, model), running(fleet, gw_a, model), running(fleet, gw_b, model)
    task = split(fleet, MLP, [a1, a2, b1], retry={"max_attempts": 1, "backoff_s": 0})
    fleet.tick()
    placed = by_role(fleet, task["id"])
    heads = {w["target_id"]: w for w in placed[SPLIT_HEAD]}
    tails = {w["target_id"]: w for w in placed[SPLIT_TAIL]}
    for w in [*heads.values(), *tails.values()]:
        fleet.report(w, "RUNNING")

    # Execute: one of gw_a's two devices goes away
    fleet.set_offline(a1)
    fleet.tick()

    # Assert: its head is LOST, gw_a's tail stays for the other head
    assert fleet.worker_row(heads[a1]["id"]).state == "LOST"
    assert {w["target_id"] for w in active(fleet, task["id"])[SPLIT_TAIL]} == {gw_a, gw_b}
    assert [o.worker_id for o in node_orders(fleet, gw_a)] == [tails[gw_a]["id"]]

    # Execute: gw_a's other device goes away too
    fleet.set_offline(a2)
    fleet.tick()

    # Assert: no head under gw_a: its tail is withdrawn (CANCELED, its order gone); gw_b's stays; the task runs on
    assert fleet.worker_row(heads[a2]["id"]).state == "LOST"
    withdrawn = fleet.worker_row(tails[gw_a]["id"])
    assert withdrawn.state == "CANCELED" and "no head" in withdrawn.detail and withdrawn.replaced_by == "-"
    assert node_orders(fleet, gw_a) == []
    assert [w["id"] for w in active(fleet, task["id"])[SPLIT_TAIL]] == [tails[gw_b]["id"]]
    assert fleet.task(task["id"])["state"] == "RUNNING"

    # Execute: the last head finishes
    fleet.report(heads[b1], "SUCCEEDED")
    fleet.tick()

    # Assert: the task ends with its heads (SUCCEEDED: a head succeeded) though a tail was still running; the
    # tail ends with it, its order withdrawn; no new tail anywhere
    done = fleet.task(task["id"])
    assert done["state"] == "SUCCEEDED", done
    assert active(fleet, task["id"]) == {SPLIT_HEAD: [], SPLIT_TAIL: []}
    assert fleet.worker_row(tails[gw_b]["id"]).state == "SUCCEEDED"
    assert node_orders(fleet, gw_a) == [] and node_orders(fleet, gw_b) == []
    assert len(fleet.workers(task["id"])) == 5
    fleet.tick()
    assert len(fleet.workers(task["id"])) == 5 and fleet.controller.due(datetime.now(UTC)) == []


def test_a_task_whose_heads_are_all_lost_fails_and_takes_its_queued_tail_with_it(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload(fleet, MLP, fixture_model(MLP))
    device = running(fleet, gw, model)
    task = split(fleet, MLP, [device], retry={"max_attempts": 1, "backoff_s": 0})
    fleet.tick()
    (head,), (tail,) = by_role(fleet, task["id"])[SPLIT_HEAD], by_role(fleet, task["id"])[SPLIT_TAIL]
    fleet.report(head, "RUNNING")  # the tail never reports
    fleet.set_offline(device)
    fleet.tick()
    done = fleet.task(task["id"])
    assert done["state"] == "FAILED", done
    assert fleet.worker_row(head["id"]).state == "LOST" and fleet.worker_row(tail["id"]).state == "CANCELED"
    assert node_orders(fleet, gw) == [] and fleet.orders(device) == []


def test_a_lost_head_takes_its_tail_and_its_replacement_brings_one_back(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw_a, gw_b = fleet.node("a"), fleet.node("b")
    model = upload(fleet, MLP, fixture_model(MLP))
    a1, b1 = running(fleet, gw_a, model), running(fleet, gw_b, model)
    task = split(fleet, MLP, [a1, b1], retry={"max_attempts": 3, "backoff_s": 1})
    fleet.tick()
    placed = by_role(fleet, task["id"])
    heads = {w["target_id"]: w for w in placed[SPLIT_HEAD]}
    tails = {w["target_id"]: w for w in placed[SPLIT_TAIL]}

    fleet.set_offline(a1)
    fleet.tick()
    assert fleet.worker_row(heads[a1]["id"]).state == "LOST"
    assert fleet.worker_row(tails[gw_a]["id"]).state == "CANCELED" and node_orders(fleet, gw_a) == []
    assert fleet.task(task["id"])["state"] == "SCHEDULED"

    # the device is back: after the back-off its head is placed again, and a new tail on its edge with it
    fleet.set_online(a1)
    fleet.tick(later(2))
    now_active = active(fleet, task["id"])
    new_head = [w for w in now_active[SPLIT_HEAD] if w["target_id"] == a1]
    assert len(new_head) == 1 and new_head[0]["attempt"] == 2
    assert sorted(w["target_id"] for w in now_active[SPLIT_TAIL]) == sorted([gw_a, gw_b])
    (new_tail,) = [w for w in now_active[SPLIT_TAIL] if w["target_id"] == gw_a]
    assert new_tail["id"] != tails[gw_a]["id"]
    assert [o.worker_id for o in node_orders(fleet, gw_a)] == [new_tail["id"]]
    assert fleet.worker_row(tails[gw_a]["id"]).replaced_by == "-"  # withdrawn, not waiting to be replaced


def test_a_head_that_succeeds_while_others_run_withdraws_the_tail_of_its_node(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw_a, gw_b = fleet.node("a"), fleet.node("b")
    model = upload(fleet, MLP, fixture_model(MLP))
    a1, b1 = running(fleet, gw_a, model), running(fleet, gw_b, model)
    task = split(fleet, MLP, [a1, b1], duration_s=60)
    fleet.tick()
    placed = by_role(fleet, task["id"])
    heads = {w["target_id"]: w for w in placed[SPLIT_HEAD]}
    tails = {w["target_id"]: w for w in placed[SPLIT_TAIL]}
    for w in [*heads.values(), *tails.values()]:
        fleet.report(w, "RUNNING")

    fleet.report(heads[a1], "SUCCEEDED")  # its duration is over; b1's head runs on
    fleet.tick()

    assert fleet.task(task["id"])["state"] == "RUNNING"
    assert fleet.worker_row(tails[gw_a]["id"]).state == "CANCELED"
    assert node_orders(fleet, gw_a) == []


def test_a_lost_tail_is_replaced_when_its_node_is_back_while_heads_remain(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    # Prepare: two heads under one node, one tail
    gw = fleet.node()
    model = upload(fleet, MLP, fixture_model(MLP))
    a1, a2 = running(fleet, gw, model), running(fleet, gw, model)
    task = split(fleet, MLP, [a1, a2])
    fleet.tick()
    placed = by_role(fleet, task["id"])
    (tail,) = placed[SPLIT_TAIL]
    for w in [*placed[SPLIT_HEAD], tail]:
        fleet.report(w, "RUNNING")

    # Execute: the edge node drops off (its devices' last reports still stand)
    set_node(fleet, gw, ConnectionState.OFFLINE)
    fleet.tick()

    # Assert: the tail is LOST and not replaced while the node is away; the heads run on; the task stays due
    lost = fleet.worker_row(tail["id"])
    assert lost.state == "LOST" and lost.replaced_by is None
    assert node_orders(fleet, gw) == []
    assert len(active(fleet, task["id"])[SPLIT_HEAD]) == 2 and active(fleet, task["id"])[SPLIT_TAIL] == []
    assert fleet.task(task["id"])["state"] == "RUNNING"
    fleet.tick()
    assert active(fleet, task["id"])[SPLIT_TAIL] == [] and len(fleet.workers(task["id"])) == 3
    assert task["id"] in fleet.controller.due(datetime.now(UTC))

    # Execute: the node is back
    set_node(fleet, gw, ConnectionState.ONLINE)
    fleet.tick()

    # Assert: a new tail, with its order; the lost one points at it; the task is no longer due
    (new,) = active(fleet, task["id"])[SPLIT_TAIL]
    assert new["id"] != tail["id"] and new["target_id"] == gw and new["state"] == "QUEUED"
    assert fleet.worker_row(tail["id"]).replaced_by == new["id"]
    (order,) = node_orders(fleet, gw)
    assert order.worker_id == new["id"] and order.role == SPLIT_TAIL and order.split is not None and order.split.whole is not None
    assert task["id"] not in fleet.controller.due(datetime.now(UTC))
    assert len(fleet.workers(task["id"])) == 4


def test_a_failed_tail_is_replaced_on_its_node_at_the_next_tick(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload(fleet, MLP, fixture_model(MLP))
    device = running(fleet, gw, model)
    task = split(fleet, MLP, [device])
    fleet.tick()
    (tail,) = by_role(fleet, task["id"])[SPLIT_TAIL]
    fleet.report(tail, "FAILED", detail="onnxruntime could not load the tail")
    fleet.tick()
    (new,) = active(fleet, task["id"])[SPLIT_TAIL]
    assert new["id"] != tail["id"] and new["target_id"] == gw
    assert fleet.worker_row(tail["id"]).replaced_by == new["id"]
    (order,) = [o for o in node_orders(fleet, gw) if o.worker_id == new["id"]]  # (the ended one's stays, as any ended worker's)
    assert order.role == SPLIT_TAIL and order.split is not None and len(order.split.parts) == len(plan(fleet, task["id"])[1])
    assert fleet.task(task["id"])["state"] == "SCHEDULED"


# --- artefacts --------------------------------------------------------------------------------------


def test_the_artefacts_of_a_split_task_stay_until_the_task_is_deleted(sqlite_fleet: TaskFleet) -> None:
    fleet = sqlite_fleet
    # Prepare: two tasks sharing one cut of the CNN (the same stored head and tail)
    gw = fleet.node()
    model = upload(fleet, CNN, fixture_model(CNN))
    device = running(fleet, gw, model)
    candidates = candidate_cuts(onnx.load_from_string(fixture_model(CNN)))
    first = split(fleet, CNN, [device], cuts=[candidates[0], candidates[-1]])
    second = split(fleet, CNN, [device], cut=candidates[-1])
    _, parts = plan(fleet, first["id"])
    _, (shared,) = plan(fleet, second["id"])
    assert (shared.head_artifact_id, shared.tail_artifact_id) == (parts[1].head_artifact_id, parts[1].tail_artifact_id)
    fleet.tick()

    def delete_artifact(artifact_id: str) -> Any:
        return fleet.hub.request("DELETE", f"/artifacts/{artifact_id}", Role.OPERATOR)

    # Assert: none of the model, heads or tails can be deleted while a task holds them
    for artifact_id in [model.id, *(p.head_artifact_id for p in parts), *(p.tail_artifact_id for p in parts)]:
        doc = assert_problem(delete_artifact(artifact_id), 409, "artifact_in_use")
        assert "split_inference" in doc["detail"] and (first["id"] in doc["detail"] or second["id"] in doc["detail"]), doc
    # an active task cannot be deleted
    assert_problem(fleet.hub.request("DELETE", f"/tasks/{first['id']}", Role.OPERATOR), 409, "illegal_transition")

    # Execute: cancel and delete the first task
    fleet.act(first["id"], "cancel")
    assert fleet.hub.request("DELETE", f"/tasks/{first['id']}", Role.OPERATOR).status_code == 204

    # Assert: its plan is gone; what only it used can go; what the second task uses, and the model, cannot
    assert plan(fleet, first["id"]) == (None, [])
    assert plan(fleet, second["id"])[1] != []
    for artifact_id in (parts[0].head_artifact_id, parts[0].tail_artifact_id):
        assert delete_artifact(artifact_id).status_code == 204
        assert fleet.hub.get(f"/artifacts/{artifact_id}").status_code == 404
    for artifact_id in (model.id, shared.head_artifact_id, shared.tail_artifact_id):
        doc = assert_problem(delete_artifact(artifact_id), 409, "artifact_in_use")
        assert "split_inference" in doc["detail"] and second["id"] in doc["detail"], doc

    # Execute: the second task, stopped (a service SUCCEEDS) and deleted
    assert fleet.act(second["id"], "stop")["state"] == "SUCCEEDED"
    assert fleet.hub.request("DELETE", f"/tasks/{second['id']}", Role.OPERATOR).status_code == 204

    # Assert: no plan is left; every artefact can be deleted now
    with Session(fleet.engine) as session:
        assert session.execute(select(SplitPlan)).all() == [] and session.execute(select(SplitPartRow)).all() == []
        assert session.execute(select(TaskWorker).where(TaskWorker.task_id.in_([first["id"], second["id"]]))).all() == []  # type: ignore[attr-defined]
    for artifact_id in (shared.head_artifact_id, shared.tail_artifact_id, model.id):
        assert delete_artifact(artifact_id).status_code == 204, artifact_id
    assert artefact_count(fleet) == 0



def node_health(fleet: TaskFleet, node_id: str, health: Health) -> None:
    fleet.seq += 1
    fleet.ingest.offer(node_id, HeartbeatBody(seq=fleet.seq, health=health, agent_version="test", uptime_s=1, resources=resources()))
    fleet.ingest.flush()


def test_a_head_placed_while_its_node_is_unhealthy_gets_a_tail_when_the_node_is_well_again(sqlite_fleet: TaskFleet) -> None:
    # Prepare: the edge reports itself degraded (UNHEALTHY): its devices take heads, the edge no tail
    fleet = sqlite_fleet
    gw = fleet.node()
    model = upload(fleet, MLP, fixture_model(MLP))
    device = running(fleet, gw, model)
    node_health(fleet, gw, Health.DEGRADED)
    task = split(fleet, MLP, [device])
    fleet.tick()
    (head,) = active(fleet, task["id"])[SPLIT_HEAD]
    assert active(fleet, task["id"])[SPLIT_TAIL] == [] and node_orders(fleet, gw) == []
    fleet.report(head, "RUNNING")

    # Execute: the edge is well again
    node_health(fleet, gw, Health.OK)
    fleet.tick()

    # Assert: the head's edge gets its tail
    (tail,) = active(fleet, task["id"])[SPLIT_TAIL]
    assert tail["target_id"] == gw and [o.worker_id for o in node_orders(fleet, gw)] == [tail["id"]]
