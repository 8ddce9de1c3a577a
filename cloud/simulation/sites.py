"""The seed's demo measured on real processes (``aisynergy experiment sites``; seeds/000, issue 19).

``sites`` training sites on this machine train one network on non-IID shards of scikit-learn's digits without
their data leaving them, and the same work is done two other ways for the seed's comparison:

* **The stack**: a broker and a hub (:class:`cloud.stack.Stack`, in ``DIR``), and one real edge agent per site
  (``aisynergy edge run``, its own data directory, identity and mTLS certificate, enrolled with a one-time token),
  keeping ``train`` (its shard: a Dirichlet(``alpha``) split of the training images over labels,
  :func:`cloud.simulation.quality.dirichlet_split`) and ``test`` (the held-out images every arm is scored on); one
  more agent, ``central``, keeps the pooled shards for the centralised arm and takes no part in the others.
* **The algorithm** (a package folder, the numpy digits CNN of ``examples/algorithms`` by default) is built and
  stored with ``aisynergy algorithm build`` / ``POST /artifacts``; its initial parameters (``aisynergy algorithm
  run --rounds 0 --save``) are the start of every arm.
* **Federated**: one ``federated_training`` task over the sites (``rounds`` rounds, one fit call of the
  configuration's epochs each, every site in every round, the task's strategy and compression, ``cross_evaluation``):
  its accuracy is the published global model's on the held-out images, scored on the sites by the cross-site
  evaluation. **Local-only**: one ``training`` task per site, on its shard alone, ``rounds`` fit calls (the same
  epochs a site trains in the federation). **Centralised**: one ``training`` task on ``central``, the pooled shards,
  ``rounds`` fit calls.
* **With DP** (``dp_epsilon``): the federated arm trains by DP-SGD on every site (the algorithm's own, e.g.
  :mod:`device.algorithm.privacy` in the examples), with the noise multiplier that keeps every site within
  ``dp_epsilon`` at ``dp_delta`` over all its steps (:meth:`SitesExperiment._dp_config`); each site's reported
  ``epsilon`` is collected. The local-only and centralised arms stay non-private: the seed's target is DP within
  3 points of centralised training.
* **Communication**: bytes are measured (the hub's round metrics: the global parameters each site downloads and
  the update it uploads); their time is what they take on the declared link (``link_mbps``, plus ``latency_ms``
  each way per round), against each site's measured fit time (its ``fit_s`` per round). The share printed is the
  slowest site's: communication / (communication + fit).

Nothing is simulated but the link: every figure comes from the hub's API after the tasks ran.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from cloud.simulation.common import SimulationError
from cloud.simulation.quality import DIGITS_CLASSES, dirichlet_split, load_digits
from cloud.stack import CLI, Stack, StackError

FINAL = {"SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"}
SEED_GAIN_OVER_LOCAL_POINTS = 4.0
SEED_GAP_TO_CENTRAL_POINTS = 1.0
SEED_COMMUNICATION_PCT = 20.0
SEED_DP_GAP_TO_CENTRAL_POINTS = 3.0


@dataclass(frozen=True)
class SitesConfig:
    algorithm: Path
    sites: int = 5
    rounds: int = 20
    alpha: float = 0.5
    config: dict[str, Any] = field(default_factory=lambda: {"epochs": 1})
    strategy: str = "fedavg"
    compression: str = "none"
    link_mbps: float = 100.0
    latency_ms: float = 20.0
    seed: int = 0
    round_timeout_s: float = 600.0
    task_timeout_s: float = 7200.0
    baselines: bool = True  # the local-only and centralised arms (False: the federated task alone)
    cross_evaluation: bool = True  # the federated accuracy scored on the sites (False: None, unless inspected)
    dp_epsilon: float | None = None  # the federated arm by DP-SGD on each site, sigma calibrated to this epsilon
    dp_delta: float = 1e-5
    dp_clip_norm: float = 1.0

    def check(self) -> None:
        if not 2 <= self.sites <= 32:
            raise SimulationError(f"sites: 2 to 32 on one machine, got {self.sites}")
        if not 1 <= self.rounds <= 1000:
            raise SimulationError(f"rounds: 1 to 1000, got {self.rounds}")
        if not (self.alpha > 0 and np.isfinite(self.alpha)):
            raise SimulationError(f"alpha must be a finite number > 0, got {self.alpha}")
        if not (self.link_mbps > 0 and np.isfinite(self.link_mbps)) or not (0 <= self.latency_ms < 10_000):
            raise SimulationError("link_mbps must be > 0 and latency_ms in [0, 10000)")
        if not (self.algorithm / "algorithm.json").is_file():
            raise SimulationError(f"{self.algorithm} is not an algorithm package folder (no algorithm.json)")
        if self.dp_epsilon is not None and not (0 < self.dp_epsilon < 1000 and 0 < self.dp_delta < 0.01 and 0 < self.dp_clip_norm < 1000):
            raise SimulationError("dp_epsilon in (0, 1000), dp_delta in (0, 0.01) and dp_clip_norm in (0, 1000)")


@dataclass
class SiteFigures:
    name: str
    node_id: str
    examples: int
    labels: dict[int, int]
    local_accuracy: float | None = None
    fit_s: float = 0.0
    rounds_fitted: int = 0
    bytes_down: float = 0.0
    bytes_up: float = 0.0
    communication_s: float = 0.0
    epsilon: float | None = None  # with DP-SGD: the epsilon its algorithm reported after its last round

    @property
    def communication_pct(self) -> float:
        total = self.communication_s + self.fit_s
        return 100.0 * self.communication_s / total if total > 0 else 0.0


@dataclass
class SitesResult:
    config: dict[str, Any]
    sites: list[SiteFigures]
    federated_accuracy: float | None
    centralised_accuracy: float | None
    rounds: list[dict[str, float]]
    task_ids: dict[str, Any]
    wall_s: dict[str, float]
    machine: dict[str, Any]

    @property
    def local_mean(self) -> float | None:
        scored = [s.local_accuracy for s in self.sites if s.local_accuracy is not None]
        return float(np.mean(scored)) if scored else None

    @property
    def slowest(self) -> SiteFigures:
        return max(self.sites, key=lambda s: s.fit_s + s.communication_s)

    def comparison(self) -> dict[str, Any]:
        fed, cen, local = self.federated_accuracy, self.centralised_accuracy, self.local_mean
        gain = None if fed is None or local is None else 100 * (fed - local)
        gap = None if fed is None or cen is None else 100 * (cen - fed)
        share = self.slowest.communication_pct
        per_round = [r.get("bytes_up", 0.0) + r.get("bytes_down", 0.0) for r in self.rounds]
        met = {f"federated >= local-only + {SEED_GAIN_OVER_LOCAL_POINTS:g} points": gain is not None and gain >= SEED_GAIN_OVER_LOCAL_POINTS}
        target = self.config.get("dp_epsilon")
        if target is None:
            met[f"federated within {SEED_GAP_TO_CENTRAL_POINTS:g} point of centralised"] = gap is not None and gap <= SEED_GAP_TO_CENTRAL_POINTS
        else:  # the seed's privacy target: DP at epsilon 8 within 3 points of (non-private) centralised training
            spent = [s.epsilon for s in self.sites]
            met[f"federated with DP-SGD at epsilon {target:g} within {SEED_DP_GAP_TO_CENTRAL_POINTS:g} points of centralised"] = (
                gap is not None and gap <= SEED_DP_GAP_TO_CENTRAL_POINTS)  # fmt: skip
            met[f"every site's reported epsilon <= {target:g}"] = all(e is not None and e <= target * (1 + 1e-6) for e in spent)
        met[f"communication < {SEED_COMMUNICATION_PCT:g}% of the slowest site's time"] = share < SEED_COMMUNICATION_PCT
        return {
            "federated_minus_local_points": gain, "centralised_minus_federated_points": gap,
            "communication_pct_slowest": share, "slowest_site": self.slowest.name,
            "bytes_per_round": float(np.mean(per_round)) if per_round else 0.0, "met": met,
        }  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {"kind": "experiment-sites", "config": self.config, "comparison": self.comparison(),
                "federated_accuracy": self.federated_accuracy, "centralised_accuracy": self.centralised_accuracy,
                "local_mean_accuracy": self.local_mean, "sites": [asdict(s) | {"communication_pct": s.communication_pct} for s in self.sites],
                "rounds": self.rounds, "task_ids": self.task_ids, "wall_s": self.wall_s, "machine": self.machine}  # fmt: skip


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_shards(directory: Path, sites: int, alpha: float, seed: int) -> tuple[list[Path], Path, Path, list[dict[int, int]]]:
    """Each site's ``train.npz`` (a Dirichlet(α) share of the training images), the pooled ``train.npz`` of
    ``central`` and the held-out ``test.npz``; ``x`` N x 1 x 8 x 8 float32 in [0, 1], ``y`` int64."""
    data = load_digits(seed=seed)
    parts = dirichlet_split(data.y_train, sites, alpha, np.random.default_rng(seed), classes=DIGITS_CLASSES)
    image = lambda x: x.reshape(-1, 1, 8, 8).astype(np.float32)  # noqa: E731
    directory.mkdir(parents=True, exist_ok=True)
    shards, labels = [], []
    for k, rows in enumerate(parts):
        path = directory / f"site-{k + 1}-train.npz"
        np.savez(path, x=image(data.x_train[rows]), y=data.y_train[rows])
        shards.append(path)
        labels.append({int(c): int(n) for c, n in zip(*np.unique(data.y_train[rows], return_counts=True), strict=True)})
    pooled, test = directory / "central-train.npz", directory / "test.npz"
    np.savez(pooled, x=image(data.x_train), y=data.y_train)
    np.savez(test, x=image(data.x_test), y=data.y_test)
    return shards, pooled, test, labels


class SitesExperiment:
    def __init__(self, cfg: SitesConfig, data_dir: Path, echo: Callable[[str], None] = print,
                 inspect: Callable[[SitesExperiment, str], None] | None = None) -> None:  # fmt: skip
        """``inspect``: called with this experiment and the federated task's id once it SUCCEEDED, the stack still up
        (``call`` reads the hub's API)."""
        cfg.check()
        self.cfg, self.dir, self.echo, self.inspect = cfg, data_dir, echo, inspect
        self.stack = Stack(data_dir, hub_port=free_port(), broker_port=free_port(), devices=0)

    # --- the stack -------------------------------------------------------------------------------

    def _api(self) -> httpx.Client:
        client = self.stack.api()
        client.timeout = httpx.Timeout(60.0)
        return client

    def call(self, method: str, path: str, **kw: Any) -> Any:
        with self._api() as api:
            r = api.request(method, path, **kw)
        if r.status_code >= 400:
            raise SimulationError(f"{method} {path}: {r.status_code} {r.text[:500]}")
        return r.json() if r.content else None

    def _edge(self, name: str, datasets: dict[str, Path]) -> str:
        registered = self.call("POST", "/nodes", json={"name": name, "labels": {"experiment": "sites"}})
        node_id = registered["node"]["id"]
        extra = [arg for local, path in datasets.items() for arg in ("--dataset", f"{local}={path}")]
        self.stack.start_edge(name, node_id, registered["bootstrap_token"], registered["ca_sha256"], extra)
        return str(node_id)

    def _ready(self, node_ids: list[str], timeout: float = 120) -> None:
        """Every node's heartbeat reports its frameworks: only then is it placed."""
        deadline = time.monotonic() + timeout
        waiting = list(node_ids)
        while waiting and time.monotonic() < deadline:
            waiting = [n for n in waiting if not ((self.call("GET", f"/nodes/{n}/status").get("resources") or {}).get("frameworks"))]
            if waiting:
                time.sleep(0.5)
        if waiting:
            raise SimulationError(f"no heartbeat with frameworks from {', '.join(waiting)} in {timeout:.0f} s")

    def _cli(self, *args: str) -> str:
        out = subprocess.run([*CLI, *args], capture_output=True, text=True, env={**os.environ, "AISYNERGY_LOG_LEVEL": "WARNING"})
        if out.returncode != 0:
            raise SimulationError(f"aisynergy {' '.join(args[:2])} failed: {(out.stderr or out.stdout).strip()[-800:]}")
        return out.stdout

    def _upload(self, path: Path, kind: str, name: str, version: str, fmt: str) -> dict[str, Any]:
        with path.open("rb") as stream:
            return self.call("POST", "/artifacts", data={"kind": kind, "name": name, "version": version, "format": fmt},  # type: ignore[no-any-return]
                              files={"file": (path.name, stream, "application/octet-stream")})  # fmt: skip

    def _task(self, body: dict[str, Any]) -> str:
        return str(self.call("POST", "/tasks", json={"heartbeat_s": 1.0, **body})["id"])

    def _final(self, task_ids: list[str]) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + self.cfg.task_timeout_s
        done: dict[str, dict[str, Any]] = {}
        shown: dict[str, Any] = {}
        while len(done) < len(task_ids):
            if time.monotonic() > deadline:
                raise SimulationError(f"tasks not final in {self.cfg.task_timeout_s:.0f} s: {sorted(set(task_ids) - set(done))}")
            failed = self.stack.failed()
            if failed is not None:
                raise SimulationError(f"{failed.name} exited with {failed.proc.returncode} (see {self.dir}/logs/{failed.name}.log)")
            for task_id in task_ids:
                if task_id in done:
                    continue
                task = self.call("GET", f"/tasks/{task_id}")
                step = task.get("items_done")
                if task["type"] == "federated_training":  # the hub's round metrics: the last round closed
                    hub = self.call("GET", f"/tasks/{task_id}/metrics?worker=hub")["workers"].get("hub")
                    step = int(hub["values"].get("round", 0)) if hub else 0
                progress = (task["state"], step)
                if shown.get(task_id) != progress and (step is None or step % 10 == 0 or shown.get(task_id, (None,))[0] != task["state"]):
                    shown[task_id] = progress
                    total = task.get("items_total") or (task["spec"].get("rounds") if task["type"] == "federated_training" else None)
                    self.echo(f"  {task_id}: {task['state']}" + (f", {step} of {total}" + (" rounds" if task["type"] == "federated_training" else "") if total and step is not None else ""))
                if task["state"] in FINAL:
                    done[task_id] = task
            time.sleep(1.0)
        return done

    def _logs_tail(self, task_id: str, lines: int = 15) -> str:
        items: list[dict[str, Any]] = []
        while True:  # page after page: the newest lines are on the last
            page = self.call("GET", f"/tasks/{task_id}/logs?limit=500" + (f"&after={items[-1]['id']}" if items else ""))
            items = (items + page["items"])[-lines:]
            if page["next_cursor"] is None:
                return "\n".join(line["text"] for line in items)

    def _succeeded(self, done: dict[str, dict[str, Any]], what: str) -> None:
        for task_id, task in done.items():
            if task["state"] != "SUCCEEDED":
                raise SimulationError(f"{what} task {task_id} ended {task['state']}: {task.get('reason') or ''}\n{self._logs_tail(task_id)}")

    # --- the run ---------------------------------------------------------------------------------

    def run(self) -> SitesResult:
        from cloud.simulation.common import machine

        cfg = self.cfg
        shards, pooled, test, labels = write_shards(self.dir / "data", cfg.sites, cfg.alpha, cfg.seed)
        self.echo(f"data: {cfg.sites} non-IID shards (alpha {cfg.alpha:g}) of {sum(sum(c.values()) for c in labels)} training images, "
                  f"{len(np.load(test)['y'])} held out")  # fmt: skip
        try:
            return self._run(shards, pooled, test, labels, machine())
        finally:
            self.stack.stop()

    def _run(self, shards: list[Path], pooled: Path, test: Path, labels: list[dict[int, int]], host: dict[str, Any]) -> SitesResult:
        cfg = self.cfg
        started = time.perf_counter()
        try:
            self.stack.start_hub()
        except StackError as exc:
            raise SimulationError(f"the hub did not start: {exc}") from None
        self.echo(f"hub {self.stack.hub_url}, broker {self.stack.broker_url} (data in {self.dir})")
        sites = []
        for k, shard in enumerate(shards):
            name = f"site-{k + 1}"
            node_id = self._edge(name, {"train": shard, "test": test})
            sites.append(SiteFigures(name, node_id, sum(labels[k].values()), labels[k]))
            self.echo(f"{name}: edge agent ONLINE as {node_id}, {sites[-1].examples} images, labels {labels[k]}")
        central = self._edge("central", {"train": pooled, "test": test}) if cfg.baselines else None
        self._ready([s.node_id for s in sites] + ([central] if central else []))
        wall = {"stack_s": time.perf_counter() - started}

        package = Path(self._cli("algorithm", "build", str(cfg.algorithm), "--out", str(self.dir / "package")).strip().splitlines()[-1])
        manifest = json.loads((cfg.algorithm / "algorithm.json").read_text())
        algorithm = self._upload(package, "algorithm", manifest["name"], manifest["version"], "zip")
        initial_file = self.dir / "initial.safetensors"
        self._cli("algorithm", "run", str(cfg.algorithm), "--dataset", f"train={shards[0]}", "--config", json.dumps(cfg.config), "--rounds", "0", "--save", str(initial_file))
        initial = self._upload(initial_file, "model", f"{manifest['name']}-initial"[:128], manifest["version"], "safetensors")
        ref = {"name": algorithm["name"], "version": algorithm["version"]}
        datasets = {"train": "train", "test": "test"}
        self.echo(f"algorithm {ref['name']} {ref['version']} stored ({algorithm['id']}); initial parameters {initial['id']}")

        # federated: every site in every round (with dp_epsilon: by DP-SGD on each site)
        fed_config = cfg.config if cfg.dp_epsilon is None else self._dp_config(manifest, sites)
        spec = {"algorithm": ref, "datasets": datasets, "config": fed_config, "initial_parameters": initial["id"], "rounds": cfg.rounds,
                "min_participants": cfg.sites, "round_timeout_s": cfg.round_timeout_s, "strategy": cfg.strategy, "compression": cfg.compression,
                "cross_evaluation": cfg.cross_evaluation, "output": {"name": f"{manifest['name']}-federated"[:128]}}  # fmt: skip
        self.echo(f"federated: {cfg.rounds} rounds of {cfg.strategy} over {cfg.sites} sites")
        t0 = time.perf_counter()
        fed_id = self._task({"type": "federated_training", "spec": spec, "placement": {"target": "node", "ids": [s.node_id for s in sites]}})
        self._succeeded(self._final([fed_id]), "the federated")
        wall["federated_s"] = time.perf_counter() - t0
        outputs = self.call("GET", f"/tasks/{fed_id}/outputs")
        scores = [c["metrics"].get("accuracy") for c in outputs["evaluation"] if c["model"] == "global"]
        federated = float(np.mean([s for s in scores if s is not None])) if any(s is not None for s in scores) else None
        rounds = [m["values"] for m in self.call("GET", f"/tasks/{fed_id}/metrics?series=true&worker=hub")["series"] if "round_s" in m["values"]]
        self._site_figures(fed_id, sites, rounds)
        if self.inspect is not None:
            self.inspect(self, fed_id)
        if central is None:
            wall["total_s"] = time.perf_counter() - started
            return SitesResult(config={**asdict(cfg), "algorithm": str(cfg.algorithm), "algorithm_ref": ref, "federated_config": fed_config}, sites=sites, federated_accuracy=federated,
                               centralised_accuracy=None, rounds=rounds, task_ids={"federated": fed_id}, wall_s=wall, machine=host)  # fmt: skip

        # local-only: each site alone, the same fit calls; centralised: the pooled shards on central
        t0 = time.perf_counter()
        local_ids = {}
        for site in sites:
            body = {"algorithm": ref, "datasets": datasets, "config": cfg.config, "steps": cfg.rounds, "checkpoint_every": cfg.rounds,
                    "initial_parameters": initial["id"], "output": {"name": f"{manifest['name']}-local-{site.name}"[:128]}}  # fmt: skip
            local_ids[site.name] = self._task({"type": "training", "spec": body, "placement": {"target": "node", "ids": [site.node_id]}})
        body = {"algorithm": ref, "datasets": datasets, "config": cfg.config, "steps": cfg.rounds, "checkpoint_every": cfg.rounds,
                "initial_parameters": initial["id"], "output": {"name": f"{manifest['name']}-centralised"[:128]}}  # fmt: skip
        central_id = self._task({"type": "training", "spec": body, "placement": {"target": "node", "ids": [central]}})
        self.echo(f"local-only on each site and centralised on the pooled shards: {cfg.rounds} fit calls each")
        self._succeeded(self._final([*local_ids.values(), central_id]), "a local-only or centralised")
        wall["local_and_centralised_s"] = time.perf_counter() - t0
        for site in sites:
            (trained,) = self.call("GET", f"/tasks/{local_ids[site.name]}/outputs")["trained"]
            site.local_accuracy = trained["metrics"].get("accuracy")
        (trained,) = self.call("GET", f"/tasks/{central_id}/outputs")["trained"]
        wall["total_s"] = time.perf_counter() - started
        return SitesResult(
            config={**asdict(cfg), "algorithm": str(cfg.algorithm), "algorithm_ref": ref, "federated_config": fed_config}, sites=sites, federated_accuracy=federated,
            centralised_accuracy=trained["metrics"].get("accuracy"), rounds=rounds,
            task_ids={"federated": fed_id, "local": local_ids, "centralised": central_id}, wall_s=wall, machine=host,
        )  # fmt: skip

    def _dp_config(self, manifest: dict[str, Any], sites: list[SiteFigures]) -> dict[str, Any]:
        """The federated arm's configuration with DP-SGD: the noise multiplier that keeps every site within
        ``dp_epsilon`` after all its steps (``rounds`` fit calls of ``epochs`` epochs of ceil(n / batch_size) steps,
        Poisson sampling at batch_size / n): the largest of the sites' (the smallest shard's sample rate is the
        highest). The algorithm must take ``dp_noise_multiplier`` (the examples do: device.algorithm.privacy)."""
        from cloud.simulation.dp_sgd import calibrate_sigma

        cfg = self.cfg
        assert cfg.dp_epsilon is not None
        schema = manifest.get("config_schema", {}).get("properties", {})
        if "dp_noise_multiplier" not in schema:
            raise SimulationError(f"{manifest['name']} takes no dp_noise_multiplier: its fit does no DP-SGD")
        value = {k: cfg.config.get(k, schema.get(k, {}).get("default")) for k in ("batch_size", "epochs")}
        if not all(isinstance(v, int) and v > 0 for v in value.values()):
            raise SimulationError(f"DP-SGD's calibration needs batch_size and epochs (from the configuration or its schema's defaults), got {value}")
        size, epochs = value["batch_size"], value["epochs"]
        sigma = max(calibrate_sigma(min(1.0, size / s.examples), cfg.rounds * epochs * -(-s.examples // size), cfg.dp_epsilon, cfg.dp_delta)
                    for s in sites)  # fmt: skip
        self.echo(f"DP-SGD on every site: noise multiplier {sigma:.4g}, clip norm {cfg.dp_clip_norm:g}, epsilon {cfg.dp_epsilon:g} at delta {cfg.dp_delta:g} "
                  f"after {cfg.rounds} rounds of {epochs} epochs at batch size {size}")  # fmt: skip
        return {**cfg.config, "dp_noise_multiplier": sigma, "dp_clip_norm": cfg.dp_clip_norm, "dp_delta": cfg.dp_delta}

    def _site_figures(self, task_id: str, sites: list[SiteFigures], rounds: list[dict[str, float]]) -> None:
        """Each site's fit time (its ``fit_s`` of every round, from its worker's metric samples) and the bytes it
        moved (the round's global parameters down, its share of the round's uploads up), timed on the declared link."""
        cfg = self.cfg
        workers = {w["target_id"]: w["id"] for w in self.call("GET", f"/tasks/{task_id}/workers") if w["target_kind"] == "node"}
        for site in sites:
            worker_id = workers.get(site.node_id)
            if worker_id is None:
                continue
            fits: dict[int, float] = {}
            for sample in self.call("GET", f"/tasks/{task_id}/metrics?series=true&worker={worker_id}")["series"]:
                values = sample["values"]
                if "round" in values and "fit_s" in values:
                    fits[int(values["round"])] = float(values["fit_s"])
                if "epsilon" in values:
                    site.epsilon = max(site.epsilon or 0.0, float(values["epsilon"]))
            site.fit_s, site.rounds_fitted = sum(fits.values()), len(fits)
        link_bps = cfg.link_mbps * 1e6
        for r in rounds:
            contributors = max(1.0, r.get("contributors", float(len(sites))))
            down = r.get("bytes_down", 0.0) / contributors  # the global parameters, once per site
            up = r.get("bytes_up", 0.0) / contributors
            for site in sites:
                site.bytes_down += down
                site.bytes_up += up
                site.communication_s += (down + up) * 8 / link_bps + 2 * cfg.latency_ms / 1000
