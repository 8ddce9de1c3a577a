"""The ``federated_training`` worker programs (``FederatedTrainingSpec`` + the order's ``FlOrder``), by role.

**worker** (each device): checks that the model it runs is the one the hub cut and that it keeps the dataset with
labels that fit the layer, reports RUNNING, then follows the rounds its order names. For each round attempt
it has not trained yet and whose deadline has not passed: it fetches the round's global layer (a signed artefact,
verified like any download), runs ``local_steps`` SGD steps on its own data (on the frozen body's features,
computed once; FedProx adds ``mu (w - w_global)`` to each step; with ``dp`` each step is DP-SGD at the sampling
rate the hub accounted; no data leaves the device) and sends the trained
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

**Secure aggregation** (``secure_aggregation``; ``interfaces.secagg``): each participant sends an X25519 public key
(``fl.key``) when it starts; the round's order lists every participant's key, so each pair derives a shared seed
per round attempt. A participant sends its layer scaled by ``n / total_examples``, in fixed point, plus the masks
it shares with the peers above it minus those with the peers below: any one update is noise, the sum over all
participants is the weighted mean. An edge only adds the masked updates up (mod 2^32). When participants drop
after masking, the order names them (``reveal``) and each survivor sends its seeds with them (``fl.reveal``) so
the hub can remove those masks from the sum. Not covered: a hub that lies about who dropped could unmask a late
update (no threshold secret sharing of the keys, as in Bonawitz et al.): the protection is against an honest but
curious hub and edges.
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
from device.tasks.secure import PairMasks
from interfaces.tasks import FL_AGGREGATOR, FL_UPDATE_EVENT, FederatedTrainingOrder, FederatedTrainingSpec, FlOrder, FlUpdate

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("aisynergy.device.fl")

EDGE_MARGIN = 0.2
"""An aggregator sends what it has this share of the round's timeout (at most 2 s) before the deadline."""
IDLE_WAIT_S = 5.0


def run(worker: Worker) -> None:
    if worker.spec(FederatedTrainingSpec).whole:
        from device.tasks.fl_whole import aggregate as aggregate_whole, run as run_whole

        (aggregate_whole if worker.order.role == FL_AGGREGATOR else run_whole)(worker)
    elif worker.order.role == FL_AGGREGATOR:
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
        if self.spec.model is None or self.spec.dataset is None:
            raise Rejected("a last-layer participant needs the task's model and dataset")
        self.dataset: str = self.spec.dataset
        self.model = require_model(worker.models, self.spec.model)
        if worker.datasets is None:
            raise Rejected("this target keeps no local datasets")
        from device.local_data import DatasetError

        try:
            self.x, self.y = worker.datasets.load(self.dataset)
        except DatasetError as exc:
            raise Rejected(str(exc)) from None
        if len(self.y) == 0:
            raise Rejected(f"dataset {self.dataset} has no rows")
        identity = getattr(worker.fl, "identity", None)
        if not isinstance(identity, str):
            raise Rejected("this target has no federated channel (it is not a device)")
        self.identity: str = identity
        self.features: np.ndarray | None = None
        self.body_sha: str | None = None
        self.done: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self.metrics: dict[str, float] = {"rounds": 0.0}
        self.masks = PairMasks(worker)  # secure aggregation

    def run(self) -> None:
        w = self.worker
        w.metrics_source(self._sample)
        w.running()
        w.log(f"taking part in {self.spec.rounds} rounds on {len(self.y)} rows of {self.dataset} ({self.spec.strategy})")
        if self.spec.secure_aggregation:
            self.masks.send_key()
        while w.checkpoint():
            fl = w.order_as(FederatedTrainingOrder).fl
            self.masks.reveal_if_asked(fl)
            if fl is None or (fl.round, fl.attempt) in self.done:
                w.wait(IDLE_WAIT_S)
                continue
            if fl.secure and not self.masks.masks_with(fl, self.identity):  # the others did not mask with this run's key
                self.done.add((fl.round, fl.attempt))
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
        body, feature, base_sha256 = fl.body, fl.feature, fl.base_sha256
        if body is None or feature is None or base_sha256 is None:
            raise Rejected("a last-layer round's order names the body, its feature and the model it was cut from")
        if self.model.sha256 != base_sha256:
            raise Rejected(f"the loaded {self.model.name} {self.model.version} ({self.model.sha256[:12]}) is not the model the hub cut ({base_sha256[:12]})")
        started = time.perf_counter()
        if self.features is None or self.body_sha != body.signed_manifest.manifest.sha256:
            try:
                self.features = body_features(w.fetch_inputs(body), self.x, feature, go_on=w.checkpoint, with_ones=True)
            except Stopped:
                return False
            except ValueError as exc:
                raise Failed(f"the body does not run on {self.dataset}: {exc}") from exc
            self.body_sha = body.signed_manifest.manifest.sha256
        weight, bias = _layer(w.fetch_inputs(fl.weights).read_bytes())
        if self.y.min() < 0 or self.y.max() >= weight.shape[1]:
            raise Rejected(f"dataset {self.dataset}'s labels run {int(self.y.min())}..{int(self.y.max())}; the layer has {weight.shape[1]} classes")
        mu = float(spec.strategy_params.get("mu", 0.01)) if spec.strategy == "fedprox" else 0.0
        if spec.dp is not None and fl.sample_rate is None:
            raise Rejected("a differentially private round must carry the sampling rate the hub accounted")
        clip, sigma = (spec.dp.clip_norm, spec.dp.noise_multiplier) if spec.dp is not None else (float("inf"), 0.0)
        try:
            trainer = HeadTrainer(
                weight, bias, self.features, self.y, learning_rate=spec.learning_rate, clip_norm=clip, noise_multiplier=sigma,
                sample_rate=fl.sample_rate or min(1.0, spec.batch_size / len(self.y)), augmented=True, proximal_mu=mu,
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
        if fl.secure:
            if not fl.total_examples:
                raise Failed("secure aggregation: no total of examples in the order")
            layer = {"weight": trainer.weight, "bias": trainer.bias}
            frame = save(self.masks.mask(fl, self.identity, layer, len(self.y) / fl.total_examples))
        update = FlUpdate(
            task_id=w.task_id, worker_id=w.worker_id, round=fl.round, attempt=fl.attempt, contributors=[self.identity], num_examples=len(self.y),
            data=base64.b64encode(frame).decode("ascii"), metrics=metrics, masked=fl.secure,
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
    from interfaces.aggregation import ClientUpdate, combine, weighted_metrics

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
            frame, examples, metrics, contributors = base64.b64decode(one.data or ""), one.num_examples, one.metrics, one.contributors
        elif fl.secure:  # masked: only their sum (mod 2^32) means anything; the hub removes the masks
            from safetensors.numpy import load, save

            frames = [load(base64.b64decode(u.data or "")) for u in updates]
            frame = save({name: sum(f[name] for f in frames[1:]) + frames[0][name] for name in frames[0]})
            examples = sum(u.num_examples for u in updates)
            metrics = weighted_metrics([ClientUpdate({}, u.num_examples, u.metrics) for u in updates])
            contributors = sorted(c for u in updates for c in u.contributors)
        else:
            from safetensors.numpy import load, save

            merged = combine([ClientUpdate(load(base64.b64decode(u.data or "")), u.num_examples, u.metrics, u.contributors[0]) for u in updates])
            frame, examples, metrics = save(dict(merged.weights)), merged.num_examples, merged.metrics
            contributors = sorted(c for u in updates for c in u.contributors)
        worker.event(FL_UPDATE_EVENT, FlUpdate(
            task_id=worker.task_id, worker_id=worker.worker_id, round=fl.round, attempt=fl.attempt, contributors=contributors, num_examples=examples,
            data=base64.b64encode(frame).decode("ascii"), metrics=metrics, masked=fl.secure,
        ))  # fmt: skip

    router.serve(worker.task_id, offer)
    try:
        worker.metrics_source(lambda: dict(counts))
        worker.running()
        sent: dict[tuple[int, int], set[str]] = {}
        window: dict[tuple[int, int], float] = {}  # seconds left when this node first saw each round attempt (sync adaptive: shorter)
        while worker.checkpoint():
            fl = worker.order_as(FederatedTrainingOrder).fl
            wait: float | None = IDLE_WAIT_S
            if fl is not None:
                key = (fl.round, fl.attempt)
                with lock:
                    for old in [k for k in inbox if k < key]:
                        del inbox[old]
                    got = {d: u for d, u in inbox.get(key, {}).items() if d in fl.participants}
                left = _seconds_left(fl)
                length = min(spec.round_timeout_s, max(0.0, window.setdefault(key, left)))
                send_at = left - min(2.0, EDGE_MARGIN * length)
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
                for old in [k for k in window if k < key]:
                    del window[old]
            worker.wait(wait)
    finally:
        router.unserve(worker.task_id, offer)
