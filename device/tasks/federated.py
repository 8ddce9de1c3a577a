"""The ``federated_training`` worker programs (``FederatedTrainingSpec`` + the order's ``FlOrder``), by role.

**worker** (each device): checks that the model it runs is the one the hub cut and that it keeps the dataset with
labels that fit the layer, reports RUNNING, then follows the rounds its order names. For each round attempt
it has not trained yet and whose deadline has not passed: it fetches the round's global layer (a signed artefact,
verified like any download), runs ``local_steps`` SGD steps on its own data (on the frozen body's features,
computed once; FedProx adds ``mu (w - w_global)`` to each step; no data leaves the device) and sends the trained
layer with the examples it holds and its loss and accuracy on its own data: to its edge's aggregator on ``fl``
(``via_edge``), else as an ``fl.update`` event to the hub. A participant that missed a round (stopped, slow,
offline) simply starts the next one from the new global layer: a reset, never a stale continuation. Metrics:
``rounds``, ``round``, ``loss``, ``accuracy``, ``train_s``, ``examples``.

**aggregator** (each edge node under the devices of a hierarchical task with a decomposable strategy): collects
its devices' updates for the round attempt in progress (:class:`edge.fl.FlRouter`); when every participant under
it answered, or ``EDGE_MARGIN`` before the round's deadline with at least one, it sends ONE update: their
sample-weighted mean (``interfaces.aggregation.combine``), ``num_examples`` their sum, its contributors those
devices. An update that arrives after that, still for the round in progress, is forwarded on its own. Metrics:
``rounds``, ``updates``, ``forwarded``.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from device.tasks.programs import require_model
from device.tasks.worker import Failed, Rejected, Worker
from interfaces.tasks import FL_AGGREGATOR, FL_UPDATE_EVENT, FederatedTrainingSpec, FlOrder, FlUpdate

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("aisynergy.device.fl")

EDGE_MARGIN = 0.2
"""An aggregator sends what it has this share of the round's timeout (at most 2 s) before the deadline."""
IDLE_WAIT_S = 5.0


def run(worker: Worker) -> None:
    if worker.order.role == FL_AGGREGATOR:
        _aggregate(worker)
    else:
        _Participant(worker).run()


def _seconds_left(fl: FlOrder) -> float:
    return (fl.deadline_at - datetime.now(UTC)).total_seconds()


def _layer(frame: bytes) -> tuple[np.ndarray, np.ndarray]:
    from safetensors.numpy import load

    try:
        tensors = load(frame)
        weight, bias = tensors["weight"], tensors["bias"]
    except Exception as exc:  # noqa: BLE001 - safetensors' errors, KeyError
        raise Rejected(f"the round's global layer is not a safetensors frame of weight and bias: {exc}") from None
    if weight.ndim != 2 or bias.shape != (weight.shape[1],):
        raise Rejected(f"the round's global layer has weight {list(weight.shape)} and bias {list(bias.shape)}")
    return weight, bias


# --- a participant -----------------------------------------------------------------------------------


class _Participant:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.spec = worker.spec(FederatedTrainingSpec)
        self.model = require_model(worker.models, self.spec.model)
        if worker.datasets is None:
            raise Rejected("this target keeps no local datasets")
        from device.local_data import DatasetError

        try:
            self.x, self.y = worker.datasets.load(self.spec.dataset)
        except DatasetError as exc:
            raise Rejected(str(exc)) from None
        if len(self.y) == 0:
            raise Rejected(f"dataset {self.spec.dataset} has no rows")
        self.identity = getattr(worker.fl, "identity", None)
        if self.identity is None:
            raise Rejected("this target has no federated channel (it is not a device)")
        self.features: np.ndarray | None = None
        self.body_sha: str | None = None
        self.done: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self.metrics: dict[str, float] = {"rounds": 0.0}

    def run(self) -> None:
        w = self.worker
        w.metrics_source(self._sample)
        w.running()
        w.log(f"taking part in {self.spec.rounds} rounds on {len(self.y)} rows of {self.spec.dataset} ({self.spec.strategy})")
        while w.checkpoint():
            fl = w.order.fl
            if fl is None or (fl.round, fl.attempt) in self.done:
                w.wait(IDLE_WAIT_S)
                continue
            if _seconds_left(fl) <= 0:
                self.done.add((fl.round, fl.attempt))
                w.log(f"round {fl.round} (attempt {fl.attempt}) is past its deadline; waiting for the next one", "warning")
                continue
            if not self._round(fl):
                return

    def _round(self, fl: FlOrder) -> bool:
        """Train one round attempt and send the layer; False: stop now."""
        from safetensors.numpy import save

        from device.training.dpsgd import HeadTrainer
        from device.training.features import Stopped, body_features

        w, spec = self.worker, self.spec
        if self.model.sha256 != fl.base_sha256:
            raise Rejected(f"the loaded {self.model.name} {self.model.version} ({self.model.sha256[:12]}) is not the model the hub cut ({fl.base_sha256[:12]})")
        started = time.perf_counter()
        if self.features is None or self.body_sha != fl.body.signed_manifest.manifest.sha256:
            try:
                self.features = body_features(w.fetch_inputs(fl.body), self.x, fl.feature, go_on=w.checkpoint, with_ones=True)
            except Stopped:
                return False
            except ValueError as exc:
                raise Failed(f"the body does not run on {spec.dataset}: {exc}") from exc
            self.body_sha = fl.body.signed_manifest.manifest.sha256
        weight, bias = _layer(w.fetch_inputs(fl.weights).read_bytes())
        if self.y.min() < 0 or self.y.max() >= weight.shape[1]:
            raise Rejected(f"dataset {spec.dataset}'s labels run {int(self.y.min())}..{int(self.y.max())}; the layer has {weight.shape[1]} classes")
        mu = float(spec.strategy_params.get("mu", 0.01)) if spec.strategy == "fedprox" else 0.0
        try:
            trainer = HeadTrainer(
                weight, bias, self.features, self.y, learning_rate=spec.learning_rate, clip_norm=float("inf"), noise_multiplier=0.0,
                sample_rate=min(1.0, spec.batch_size / len(self.y)), augmented=True, proximal_mu=mu,
            )  # fmt: skip
        except ValueError as exc:
            raise Failed(str(exc)) from exc
        losses = []
        try:
            for _ in range(spec.local_steps):
                if not w.checkpoint():
                    return False
                stats = trainer.step()
                if stats.batch:
                    losses.append(stats.loss)
            accuracy = trainer.accuracy()
            frame = save({"weight": trainer.weight.copy(), "bias": trainer.bias.copy()})
        finally:
            trainer.close()
        loss = float(sum(losses[-10:]) / len(losses[-10:])) if losses else float("nan")
        metrics = {"accuracy": accuracy} | ({"loss": loss} if losses else {})
        update = FlUpdate(
            task_id=w.task_id, worker_id=w.worker_id, round=fl.round, attempt=fl.attempt, contributors=[self.identity], num_examples=len(self.y),
            data=base64.b64encode(frame).decode("ascii"), metrics=metrics,
        )  # fmt: skip
        self.done.add((fl.round, fl.attempt))
        try:
            if fl.via_edge:
                w.fl.send(update)
            else:
                w.event(FL_UPDATE_EVENT, update)
        except Exception as exc:  # noqa: BLE001 - not connected: this round goes on without us; the next one resets us
            w.log(f"round {fl.round}: could not send the update: {exc}", "warning")
        train_s = time.perf_counter() - started
        with self._lock:
            self.metrics = {"rounds": self.metrics["rounds"] + 1, "round": float(fl.round), "accuracy": accuracy, "train_s": train_s,
                            "examples": float(len(self.y))} | ({"loss": loss} if losses else {})  # fmt: skip
        w.log(f"round {fl.round}: {spec.local_steps} steps in {train_s:.2f} s, accuracy on own data {accuracy:.4f}; sent {'to the edge' if fl.via_edge else 'to the hub'}")
        return True

    def _sample(self) -> dict[str, float]:
        with self._lock:
            return dict(self.metrics)


# --- an edge's aggregator ----------------------------------------------------------------------------


def _aggregate(worker: Worker) -> None:
    from interfaces.aggregation import ClientUpdate, combine

    spec = worker.spec(FederatedTrainingSpec)
    router = worker.fl
    if router is None or not hasattr(router, "serve"):
        raise Rejected("this target aggregates no federated updates (it is not an edge node)")
    lock = threading.Lock()
    inbox: dict[tuple[int, int], dict[str, FlUpdate]] = {}
    counts = {"rounds": 0.0, "updates": 0.0, "forwarded": 0.0}

    def offer(update: FlUpdate) -> None:
        with lock:
            inbox.setdefault((update.round, update.attempt), {}).setdefault(update.contributors[0], update)
            counts["updates"] += 1
        worker.wake()

    def send(updates: list[FlUpdate], fl: FlOrder) -> None:
        if len(updates) == 1:
            (one,) = updates
            frame, examples, metrics, contributors = base64.b64decode(one.data), one.num_examples, one.metrics, one.contributors
        else:
            from safetensors.numpy import load, save

            merged = combine([ClientUpdate(load(base64.b64decode(u.data)), u.num_examples, u.metrics, u.contributors[0]) for u in updates])
            frame, examples, metrics = save(dict(merged.weights)), merged.num_examples, merged.metrics
            contributors = sorted(c for u in updates for c in u.contributors)
        worker.event(FL_UPDATE_EVENT, FlUpdate(
            task_id=worker.task_id, worker_id=worker.worker_id, round=fl.round, attempt=fl.attempt, contributors=contributors, num_examples=examples,
            data=base64.b64encode(frame).decode("ascii"), metrics=metrics,
        ))  # fmt: skip

    router.serve(worker.task_id, offer)
    try:
        worker.metrics_source(lambda: dict(counts))
        worker.running()
        sent: dict[tuple[int, int], set[str]] = {}
        while worker.checkpoint():
            fl = worker.order.fl
            wait: float | None = IDLE_WAIT_S
            if fl is not None:
                key = (fl.round, fl.attempt)
                with lock:
                    for old in [k for k in inbox if k < key]:
                        del inbox[old]
                    got = {d: u for d, u in inbox.get(key, {}).items() if d in fl.participants}
                left = _seconds_left(fl)
                send_at = left - min(2.0, EDGE_MARGIN * spec.round_timeout_s)
                if key not in sent:
                    if got and (set(got) >= set(fl.participants) or send_at <= 0):
                        send(list(got.values()), fl)
                        sent[key] = set(got)
                        counts["rounds"] += 1
                        worker.log(f"round {fl.round}: {len(got)} of {len(fl.participants)} devices combined and sent")
                    elif left > 0:
                        wait = max(0.05, send_at) if send_at > 0 else min(IDLE_WAIT_S, left)
                else:
                    late = [u for d, u in got.items() if d not in sent[key]]
                    for update in late:  # after the combined one: each on its own, while the round is open
                        send([update], fl)
                        sent[key].add(update.contributors[0])
                        counts["forwarded"] += 1
                for old in [k for k in sent if k < key]:
                    del sent[old]
            worker.wait(wait)
    finally:
        router.unserve(worker.task_id, offer)
