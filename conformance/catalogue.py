"""The clauses the suite reports on.

Section 8 of GB/T 45401.2 (the collaboration interfaces) is not public; DESIGN §4 is the catalogue the
suite tests as 8.1 (edge node management), 8.2 (deployment and update) and 8.3 (task run management),
with 8.0 for what DESIGN §4 requires of every interface (errors, tokens, lists, idempotency, the MQTT
envelope). Sections 6 and 7 are the standard's draft text (seeds/004): every "shall" (应) and every
"should" (宜) that an interface can observe has cases; a clause no interface can observe is listed with
the reason. Ids are dotted so that ``--clause 7.2.*`` selects by glob; ``label`` is how the standard
writes them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Clause:
    id: str
    label: str
    title: str
    source: str  # DESIGN section or the standard's clause
    level: str  # shall | should | interface
    testable: bool = True
    reason: str = ""  # why a clause cannot be tested from outside


def _c(id_: str, title: str, source: str, level: str = "interface", reason: str = "") -> Clause:
    parts = id_.split(".")
    numeric = 0
    while numeric < len(parts) and parts[numeric].isdigit():
        numeric += 1
    label = " ".join([".".join(parts[:numeric]), *parts[numeric:]])  # 7.2.d.3 -> "7.2 d 3"
    return Clause(id_, label, title, source, level, testable=not reason, reason=reason)


_INTERNAL_EDGE = "happens inside the edge agent; the suite plays the edge itself, and no §8 interface exposes it"
_INTERNAL_DEVICE = "happens inside the device (its runtime and SDK); no §8 interface exposes it, and the suite's simulated devices run no model"

CATALOGUE: list[Clause] = [
    # ---- 8.0: what DESIGN §4 requires of every interface ----------------------------------------------
    _c("8.0.1", "Errors are RFC 9457 problem documents with a stable code; malformed and oversized requests are refused and change nothing", "DESIGN §4, §6"),
    _c("8.0.2", "Integrators authenticate with bearer tokens bound to roles admin | operator | viewer", "DESIGN §4, §6"),
    _c("8.0.3", "Lists page with limit/cursor ({items, next_cursor}) and filter with label selectors", "DESIGN §4"),
    _c("8.0.4", "Every write accepts Idempotency-Key: a repeat returns the first answer (one that carried a secret is refused, not replayed), a reuse with another request is refused", "DESIGN §4"),
    _c("8.0.5", "MQTT: envelopes on the topic table; a malformed or foreign message is dropped, answered with an error event, and changes nothing", "DESIGN §4.4, §6"),
    # ---- 8.1 edge node management -----------------------------------------------------------------------
    _c("8.1.1", "Pre-registration: POST /nodes gives the node (REGISTERED) and a one-time bootstrap token with an expiry", "DESIGN §4.1"),
    _c("8.1.2", "Enrolment: GET /ca.crt; CSR + bootstrap token gives a certificate with CN = node id; the token works once", "DESIGN §4.1, §6"),
    _c("8.1.3", "Nodes are read, updated (labels, description) and deleted; deletion revokes the node's certificate", "DESIGN §4.1"),
    _c("8.1.4", "Admin state LOCKED | UNLOCKED: a locked node gets no new deployments or task workers", "DESIGN §4.1"),
    _c("8.1.5", "Node status: connection state, last heartbeat, resources (CPU, memory, disk, accelerators), agent version", "DESIGN §4.1"),
    _c("8.1.6", "Node lifecycle REGISTERED → ONLINE ⇄ OFFLINE (last will), ONLINE → UNHEALTHY → ONLINE, any → DELETED", "DESIGN §4.1"),
    _c("8.1.7", "Devices under a node: POST/GET/PATCH/DELETE /devices, GET /nodes/{id}/devices, device status through its edge", "DESIGN §4.1"),
    _c("8.1.8", "Twins: versioned desired document (retained) and reported document; GET shows both and their difference", "DESIGN §4.1, §4.4"),
    _c("8.1.9", "Commands: request with response topic and correlation data; the answer, an error for an unknown command, 504 on silence", "DESIGN §4.1, §4.4"),
    # ---- 8.2 deployment and update ----------------------------------------------------------------------
    _c("8.2.1", "Artefacts: upload, content-addressed by SHA-256, Ed25519-signed manifest, HTTP Range downloads", "DESIGN §4.2"),
    _c("8.2.2", "Deployments: orders reach the targets in their desired document; executions QUEUED … ACTIVE; the deployment SUCCEEDS", "DESIGN §4.2"),
    _c("8.2.3", "Rollout strategies: all_at_once, rolling{batch_size}, canary{percent}", "DESIGN §4.2"),
    _c("8.2.4", "Deployment control: pause, resume, cancel, rollback; illegal moves are refused", "DESIGN §4.2"),
    _c("8.2.5", "Failures: max_failure_percent with failure_policy rollback (ROLLED_BACK) or halt (FAILED)", "DESIGN §4.2"),
    _c("8.2.6", "Execution state machine: out-of-order or forged progress reports are ignored", "DESIGN §4.2"),
    # ---- 8.3 task run management ------------------------------------------------------------------------
    _c("8.3.1", "Task submission: POST /tasks validates type, spec and placement; refusals store nothing", "DESIGN §4.3"),
    _c("8.3.2", "Task lifecycle PENDING → SCHEDULED → RUNNING ⇄ PAUSED → SUCCEEDED | FAILED | CANCELED | TIMED_OUT; start/stop/pause/resume/cancel/retry/delete", "DESIGN §4.3"),
    _c("8.3.3", "Workers (one per target and role), metrics, logs (also as Server-Sent Events) and outputs", "DESIGN §4.3"),
    _c("8.3.4", "Task and worker timeouts: timeout_s ends the task TIMED_OUT; a silent worker is TIMED_OUT", "DESIGN §4.3"),
    # ---- the standard, section 6 ------------------------------------------------------------------------
    _c("6.1.2.a", "Cloud devices meet GB/T 42018-2022 6.1.1.1 and 6.1.1.2", "GB/T 45401.2 6.1.2 a", "shall", "requirements of another standard on the cloud's hardware, not an interface behaviour"),
    _c("6.1.2.b.1", "Cloud supports ML frameworks for training", "GB/T 45401.2 6.1.2 b 1", "shall", "a property of the cloud's software stack; no §8 interface exposes which frameworks train"),
    _c("6.1.2.b.2", "Cloud supports distributed cluster training", "GB/T 45401.2 6.1.2 b 2", "shall", "cluster training inside the cloud is not driven through the cloud–edge–device interfaces"),
    _c("6.1.2.b.3", "Cloud visualises training and data-processing progress", "GB/T 45401.2 6.1.2 b 3", "shall"),
    _c("6.1.2.c", "Cloud offers interoperable protocols and interfaces with edge and terminal devices", "GB/T 45401.2 6.1.2 c", "shall"),
    _c("6.1.2.d", "Cloud manages training and inference task images", "GB/T 45401.2 6.1.2 d", "shall"),
    _c("6.1.2.e", "Cloud pools heterogeneous accelerators and schedules them uniformly", "GB/T 45401.2 6.1.2 e", "should"),
    _c("6.2.2.a", "Edge offers collaboration interfaces to terminals and to the cloud", "GB/T 45401.2 6.2.2 a", "shall"),
    _c("6.2.2.b", "Edge isolates data: an attack affects only the local device, not other participants", "GB/T 45401.2 6.2.2 b", "shall"),
    _c("6.2.2.c", "Edge supports video analysis, OCR, image recognition and similar applications", "GB/T 45401.2 6.2.2 c", "should", "application content, not an interface behaviour"),
    _c("6.2.2.d", "Edge processes streaming data in real time", "GB/T 45401.2 6.2.2 d", "should", _INTERNAL_EDGE),
    _c("6.2.2.e", "Edge stores real-time information locally", "GB/T 45401.2 6.2.2 e", "should", _INTERNAL_EDGE),
    _c("6.2.2.f", "Edge monitors its own state, alone or with the cloud", "GB/T 45401.2 6.2.2 f", "should"),
    _c("6.2.2.g", "Edge runs inference or training tasks", "GB/T 45401.2 6.2.2 g", "should"),
    _c("6.3.2.a", "Terminal runs (trains or infers) on a lightweight ML framework", "GB/T 45401.2 6.3.2 a", "shall", _INTERNAL_DEVICE),
    _c("6.3.2.b", "Terminal runs models without an ML framework", "GB/T 45401.2 6.3.2 b", "shall", _INTERNAL_DEVICE),
    _c("6.3.2.c", "Terminal trains collaboratively, with a distributed framework and differential privacy", "GB/T 45401.2 6.3.2 c", "should", _INTERNAL_DEVICE),
    _c("6.3.2.d", "Terminal preprocesses data (resize, pad, rotate, denoise)", "GB/T 45401.2 6.3.2 d", "should", _INTERNAL_DEVICE),
    _c("6.3.2.e", "Terminal completes inference together with the edge or cloud", "GB/T 45401.2 6.3.2 e", "should",
       "split inference runs between a device's head and an edge's tail; with both simulated by the suite nothing of the implementation is observed"),
    _c("6.3.2.f", "Several terminals are managed together and tasks are scheduled among them", "GB/T 45401.2 6.3.2 f", "should"),
    # ---- the standard, section 7 ------------------------------------------------------------------------
    _c("7.2.a", "The ML runtime environment configuration is managed on cloud, edge and terminal", "GB/T 45401.2 7.2 a", "shall"),
    _c("7.2.b.1", "Model pruning, compression and optimisation in the cloud", "GB/T 45401.2 7.2 b 1", "shall", "offered by the hub's model tooling, not by a §8 interface"),
    _c("7.2.b.2", "Federated learning", "GB/T 45401.2 7.2 b 2", "should", "the rounds run inside devices and edges; with both simulated by the suite nothing of the implementation is observed"),
    _c("7.2.b.3", "Collaborative inference within the cloud, cloud–edge or cloud–device", "GB/T 45401.2 7.2 b 3", "should",
       "the inference runs inside devices and edges; with both simulated by the suite nothing of the implementation is observed"),
    _c("7.2.b.4", "Distributed training in the cloud", "GB/T 45401.2 7.2 b 4", "shall", "cluster training inside the cloud is not driven through the cloud–edge–device interfaces"),
    _c("7.2.b.5", "Cloud–edge incremental training", "GB/T 45401.2 7.2 b 5", "should", "needs real training on a device or edge; the suite's simulated agents train nothing"),
    _c("7.2.c.1", "Fault tolerance: a node or link failure during a task does not stop the task", "GB/T 45401.2 7.2 c 1", "shall"),
    _c("7.2.c.2", "One programming model over frameworks and accelerators", "GB/T 45401.2 7.2 c 2", "should", "a property of the runtimes inside edges and devices"),
    _c("7.2.c.3", "Distributed storage set up per computing scenario", "GB/T 45401.2 7.2 c 3", "should", "storage inside the cluster is not exposed by a §8 interface"),
    _c("7.2.c.4", "Compute devices are managed; accelerators are allocated", "GB/T 45401.2 7.2 c 4", "shall"),
    _c("7.2.d.1", "Decentralised collaboration among terminals", "GB/T 45401.2 7.2 d 1", "should", "terminal-to-terminal collaboration does not pass through the hub's interfaces"),
    _c("7.2.d.2", "Node state, including resource use, is maintained and shared in real time", "GB/T 45401.2 7.2 d 2", "shall"),
    _c("7.2.d.3", "Scheduling is real-time, with timeouts (links may be unstable)", "GB/T 45401.2 7.2 d 3", "shall"),
    _c("7.2.d.4", "Scheduling adapts to device state and capability", "GB/T 45401.2 7.2 d 4", "should"),
    _c("7.2.d.5", "Scheduling does not disturb other applications on the device", "GB/T 45401.2 7.2 d 5", "shall", "resource limits are applied inside the agent that runs the worker; the suite's simulated agents run none"),
    _c("7.3.1.a", "The ML framework runs on cloud, edge and terminal devices", "GB/T 45401.2 7.3.1 a", "shall", _INTERNAL_DEVICE),
    _c("7.3.1.b.1", "Models are deployed in the cloud and, lightweight, to edges and devices", "GB/T 45401.2 7.3.1 b 1–2", "shall"),
    _c("7.3.1.b.3", "Runs on memory-constrained devices", "GB/T 45401.2 7.3.1 b 3", "shall", _INTERNAL_DEVICE),
    _c("7.3.1.b.4", "Quantisation within an accepted error", "GB/T 45401.2 7.3.1 b 4", "should", "done by the hub's model tooling and measured on the model, not through a §8 interface"),
    _c("7.3.1.c", "At least one collaboration mode (cloud-train → device-infer among them)", "GB/T 45401.2 7.3.1 c", "shall"),
    _c("7.3.1.d", "Cloud-train → incremental train → infer pipelines", "GB/T 45401.2 7.3.1 d", "should", "needs real training on a device or edge; the suite's simulated agents train nothing"),
    _c("7.3.1.e", "One intermediate graph representation: the same artefact deploys to cloud, edge and device without conversion", "GB/T 45401.2 7.3.1 e", "should"),
    _c("7.3.2.a", "Virtualisation per GB/T XXXXX.1", "GB/T 45401.2 7.3.2 a", "shall", "requirements of part 1 of the standard (virtualisation), not of these interfaces"),
    _c("7.3.2.b", "Training cards, inference cards and cards for both are scheduled", "GB/T 45401.2 7.3.2 b", "shall"),
    _c("7.3.2.c", "Training is scheduled across clouds and edges; inference across clouds or edges", "GB/T 45401.2 7.3.2 c", "shall", "multi-cloud scheduling is not part of the cloud–edge–device interfaces"),
]

CLAUSES: dict[str, Clause] = {c.id: c for c in CATALOGUE}
assert len(CLAUSES) == len(CATALOGUE), "duplicate clause id"
