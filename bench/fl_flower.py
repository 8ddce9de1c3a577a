"""Whole-model federated training side by side with Flower (issue 19, deliverable 9): the same model, split, local
epochs, rounds and strategy, both as real processes talking over the network on this machine.

* **The work**: the numpy digits CNN of ``examples/algorithms/numpy_cnn`` (1,370 parameters), ``--sites`` non-IID
  shards (Dirichlet ``--alpha`` over labels, ``cloud.simulation.sites.write_shards``: the same files for both),
  ``--rounds`` rounds of FedAvg (weighted by examples), every site in every round, one ``fit`` call of
  ``--epochs`` epochs each (lr 0.05, batch 32, seed 0), from the same initial parameters. Both sides run the same
  client class, wrapped (``timed.client.TimedCNN``, written by this script) so that its ``fit`` reports the seconds
  of the fit itself (``fit_seconds``) and the accuracy of the global model it was handed on the held-out images
  (``global_accuracy``, outside the timed part): the accuracy after round r is what round r+1's fits report; after
  the last round, the published (ours) or final (Flower's) parameters are scored by this process. Its shuffle is
  seeded with the federated round on both sides, so that both run the very same computation.
* **Ours**: ``cloud.simulation.sites.SitesExperiment`` (a broker, a hub, one edge agent per site, the algorithm and
  the initial parameters stored, one ``federated_training`` task over the sites); round time is the hub's
  ``round_s`` (from the round's open to its close: orders out, downloads, the limited process of each site's fit,
  the uploads through the chunked API, the ``fl.update`` events, the tensor-by-tensor fusion), the fits' seconds
  are the site logs' (``round N: ... (fit_seconds ...)``).
* **Flower** (``flwr`` in its own virtualenv, made by this script: it pins fastapi < 0.139): its Deployment
  Engine, one ``flower-superlink`` and one ``flower-supernode`` per site (insecure, on 127.0.0.1), the app run with
  ``flwr run``; its ``ServerApp`` runs Flower's ``FedAvg`` (a subclass that only records when each round's
  messages go out and when its replies are aggregated); its ``ClientApp`` loads the site's shard named in its
  ``--node-config``.

Printed and written (``--out``): accuracy per round for both, total wall time (from the task's creation / ``flwr
run`` to the final model), mean round time and round overhead (round time minus the slowest participant's
``fit_seconds`` that round), and the ratios ours / Flower's. Usage::

    python bench/fl_flower.py [--sites 5] [--rounds 20] [--alpha 0.5] [--epochs 1] [--venv /tmp/aisynergy-flwr-venv]
        [--flwr 1.42.0] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NUMPY_CNN = ROOT / "examples" / "algorithms" / "numpy_cnn"
CONFIG = {"epochs": 1, "learning_rate": 0.05, "batch_size": 32, "seed": 0}

TIMED = '''"""The numpy digits CNN whose fit reports its own seconds and the handed global model's held-out accuracy."""

import time

import numpy as np

from numpy_cnn.client import NumpyCNN, forward


class TimedCNN(NumpyCNN):
    def fit(self, parameters, config):
        x, y = self.test
        accuracy = float((forward(parameters, x)[0].argmax(axis=1) == y).mean())
        started = time.perf_counter()
        trained, n, metrics = super().fit(parameters, config)
        return trained, n, {**metrics, "fit_seconds": time.perf_counter() - started, "global_accuracy": accuracy}
'''

SERVER = '''"""Flower's FedAvg over the sites, timed per round."""

import json
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


class TimedFedAvg(FedAvg):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.opened, self.closed, self.fits = {}, {}, {}

    def configure_train(self, server_round, arrays, config, grid):
        self.opened[server_round] = time.time()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.closed[server_round] = time.time()
        self.fits[server_round] = [dict(m.content["metrics"]) for m in replies if m.has_content()]
        return super().aggregate_train(server_round, replies)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    initial = load_file(cfg["initial"])
    strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=int(cfg["sites"]), min_available_nodes=int(cfg["sites"]))
    started = time.time()
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in initial.items()}),
                            num_rounds=int(cfg["rounds"]), train_config=ConfigRecord({}), timeout=3600)
    final = {k: v.numpy() for k, v in result.arrays.items()}
    np.savez(cfg["out"] + ".final.npz", **final)
    Path(cfg["out"]).write_text(json.dumps({"started": started, "ended": time.time(), "opened": strategy.opened, "closed": strategy.closed,
                                            "fits": strategy.fits}))
'''

CLIENT = '''"""The site: the timed numpy CNN on the shard its SuperNode's --node-config names."""

from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from timed.client import TimedCNN

CONFIG = %(config)r
app = ClientApp()
_clients = {}


def _client(context):
    key = str(context.node_config["train"])
    if key not in _clients:
        _clients[key] = TimedCNN(CONFIG, {"train": Path(key), "test": Path(str(context.node_config["test"]))})
    return _clients[key]


@app.train()
def train(msg: Message, context: Context) -> Message:
    parameters = {k: v.numpy() for k, v in msg.content["arrays"].items()}
    trained, n, metrics = _client(context).fit(parameters, {"server_round": int(msg.content["config"]["server-round"]), "round": 1})
    arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in trained.items()})
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": int(n), **{k: float(v) for k, v in metrics.items()}})}), reply_to=msg)
'''

PYPROJECT = '''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "benchapp"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "aisynergy"

[tool.flwr.app.components]
serverapp = "benchapp.server:app"
clientapp = "benchapp.client:app"

[tool.flwr.app.config]
rounds = 1
sites = 2
initial = ""
out = ""
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_venv(venv: Path, version: str) -> Path:
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", f"import flwr, sys; sys.exit(flwr.__version__ != {version!r})"]).returncode == 0:
        return venv / "bin"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"flwr=={version}", f"numpy=={np.__version__}", "safetensors", "pydantic", "jsonschema-rs"], check=True)
    return venv / "bin"


def timed_package(directory: Path) -> Path:
    """An algorithm package: the numpy example's module and the timed client (its manifest names the latter)."""
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(NUMPY_CNN / "numpy_cnn", directory / "numpy_cnn", ignore=shutil.ignore_patterns("__pycache__"))
    (directory / "timed").mkdir()
    (directory / "timed" / "__init__.py").write_text("")
    (directory / "timed" / "client.py").write_text(TIMED)
    manifest = json.loads((NUMPY_CNN / "algorithm.json").read_text())
    manifest |= {"name": "digits-numpy-cnn-timed", "entry_point": "timed.client:TimedCNN",
                 "description": "the numpy digits CNN, its fit timed and the handed global model scored (bench/fl_flower.py)"}  # fmt: skip
    (directory / "algorithm.json").write_text(json.dumps(manifest, indent=2))
    return directory


def accuracy(parameters: dict[str, np.ndarray], test: Path) -> float:
    sys.path.insert(0, str(NUMPY_CNN))
    from numpy_cnn.client import forward

    data = np.load(test)
    x, y = data["x"].astype(np.float32).reshape(-1, 1, 8, 8), data["y"]
    return float((forward(parameters, x)[0].argmax(axis=1) == y).mean())


_FIT = re.compile(r"^round (\d+): .*\((.*)\); update ")


def run_ours(args: argparse.Namespace, work: Path, package: Path, test: Path) -> dict[str, Any]:
    from safetensors.numpy import load

    from cloud.simulation.sites import SitesConfig, SitesExperiment

    seen: dict[str, Any] = {}

    def inspect(exp: SitesExperiment, task_id: str) -> None:
        task = exp.call("GET", f"/tasks/{task_id}")
        hub = [m["values"] for m in exp.call("GET", f"/tasks/{task_id}/metrics?series=true&worker=hub")["series"] if "round_s" in m["values"]]
        fits: dict[int, list[dict[str, float]]] = {}
        items: list[dict[str, Any]] = []
        while True:
            page = exp.call("GET", f"/tasks/{task_id}/logs?limit=500" + (f"&after={items[-1]['id']}" if items else ""))
            items += page["items"]
            if page["next_cursor"] is None:
                break
        for line in items:
            found = _FIT.match(line["text"])
            if found:
                metrics = dict((k, float(v)) for k, v in (pair.rsplit(" ", 1) for pair in found.group(2).split(", ")))
                fits.setdefault(int(found.group(1)), []).append(metrics)
        (published,) = exp.call("GET", f"/tasks/{task_id}/outputs")["artifacts"]
        with exp.stack.api() as api:
            final = load(api.get(f"/artifacts/{published}/content", timeout=60).content)
        seen.update(created=task["created_at"], ended=task.get("ended_at") or task.get("updated_at"), hub=hub, fits=fits, final=final)

    cfg = SitesConfig(algorithm=package, sites=args.sites, rounds=args.rounds, alpha=args.alpha, config=CONFIG, seed=args.seed, baselines=False, cross_evaluation=False)
    result = SitesExperiment(cfg, work, echo=print, inspect=inspect).run()
    rounds = []
    for r in seen["hub"]:
        k = int(r["round"])
        fits = seen["fits"].get(k, [])
        slowest = max((f["fit_seconds"] for f in fits), default=float("nan"))
        after = [f["global_accuracy"] for f in seen["fits"].get(k + 1, [])]
        rounds.append({"round": k, "round_s": r["round_s"], "slowest_fit_s": slowest, "overhead_s": r["round_s"] - slowest, "fits": len(fits),
                       "accuracy": float(np.mean(after)) if after else None})  # fmt: skip
    rounds[-1]["accuracy"] = accuracy(seen["final"], test)
    return {"rounds": rounds, "wall_s": result.wall_s["federated_s"], "setup_s": result.wall_s["stack_s"], "bytes_per_round": result.comparison()["bytes_per_round"]}


def run_flower(args: argparse.Namespace, work: Path, package: Path, shards: list[Path], test: Path, initial: Path) -> dict[str, Any]:
    bin_dir = ensure_venv(Path(args.venv), args.flwr)
    app = work / "flower-app"
    shutil.rmtree(app, ignore_errors=True)
    (app / "benchapp").mkdir(parents=True)
    (app / "benchapp" / "__init__.py").write_text("")
    (app / "benchapp" / "server.py").write_text(SERVER)
    (app / "benchapp" / "client.py").write_text(CLIENT % {"config": CONFIG})
    (app / "pyproject.toml").write_text(PYPROJECT)
    home = work / "flwr-home"
    port = free_port()
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "PYTHONPATH": os.pathsep.join([str(package), str(ROOT)]),
           "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])}  # its processes start flower-superexec
    logs = work / "flower-logs"
    logs.mkdir(exist_ok=True)
    children: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, command: list[str]) -> None:
        out = (logs / f"{name}.log").open("wb")
        children.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=work))

    try:
        t0 = time.perf_counter()
        spawn("superlink", [str(bin_dir / "flower-superlink"), "--insecure", "--port", str(port), "--database", str(work / "superlink.db")])
        _wait_port(port)
        for k, shard in enumerate(shards):
            spawn(f"supernode-{k + 1}", [str(bin_dir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
                                         "--node-config", f'train="{shard}" test="{test}"'])  # fmt: skip
        setup_s = time.perf_counter() - t0
        out = work / "flower-result.json"
        out.unlink(missing_ok=True)
        started = time.time()
        run = subprocess.run([str(bin_dir / "flwr"), "run", str(app), "bench", "--stream", "--run-config",
                              f'rounds={args.rounds} sites={args.sites} initial="{initial}" out="{out}"'], env=env, capture_output=True, text=True, timeout=7200)  # fmt: skip
        (logs / "flwr-run.log").write_text(run.stdout + run.stderr)
        if run.returncode != 0 or not out.exists():
            raise SystemExit(f"flwr run failed ({run.returncode}); see {logs}: {(run.stdout + run.stderr)[-2000:]}")
    finally:
        for child in reversed(children):
            try:
                os.killpg(child.pid, signal.SIGTERM)
                child.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(child.pid, signal.SIGKILL)
    timings = json.loads(out.read_text())
    final = dict(np.load(str(out) + ".final.npz"))
    rounds = []
    for key in sorted(timings["opened"], key=int):
        k = int(key)
        fits = timings["fits"][key]
        slowest = max(f["fit_seconds"] for f in fits)
        round_s = timings["closed"][key] - timings["opened"][key]
        after = [f["global_accuracy"] for f in timings["fits"].get(str(k + 1), [])]
        rounds.append({"round": k, "round_s": round_s, "slowest_fit_s": slowest, "overhead_s": round_s - slowest, "fits": len(fits),
                       "accuracy": float(np.mean(after)) if after else None})  # fmt: skip
    rounds[-1]["accuracy"] = accuracy(final, test)
    return {"rounds": rounds, "wall_s": timings["ended"] - started, "setup_s": setup_s, "server_s": timings["ended"] - timings["started"]}


def _wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the SuperLink did not listen on {port} in {timeout:.0f} s")


def summary(side: dict[str, Any]) -> dict[str, float]:
    rounds = side["rounds"]
    return {"round_s": float(np.mean([r["round_s"] for r in rounds])), "overhead_s": float(np.mean([r["overhead_s"] for r in rounds])),
            "slowest_fit_s": float(np.mean([r["slowest_fit_s"] for r in rounds])), "final_accuracy": rounds[-1]["accuracy"], "wall_s": side["wall_s"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--venv", default=str(Path(tempfile.gettempdir()) / "aisynergy-flwr-venv"))
    parser.add_argument("--flwr", default="1.42.0", help="the flwr version its virtualenv gets")
    parser.add_argument("--work", default=None, help="keep the stacks, logs and data here (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", choices=["flower", "ours"], default=None, help="run one side (to check it)")
    args = parser.parse_args()
    CONFIG["epochs"] = args.epochs
    from safetensors.numpy import save_file

    from cloud.simulation.sites import write_shards

    work = Path(args.work or tempfile.mkdtemp(prefix="aisynergy-vs-flower-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shards, _, test, _ = write_shards(work / "data", args.sites, args.alpha, args.seed)
    package = timed_package(work / "timed-package")
    sys.path.insert(0, str(package))
    from timed.client import TimedCNN

    initial = work / "initial.safetensors"
    save_file(TimedCNN(CONFIG, {"train": shards[0]}).initial_parameters(), str(initial))
    print(f"Flower {args.flwr} in {args.venv}; work in {work}")
    if args.only != "ours":
        flower = run_flower(args, work, package, shards, test, initial)
        print(f"Flower: {flower['wall_s']:.1f} s, rounds {json.dumps(flower['rounds'])}")
    if args.only != "flower":
        ours = run_ours(args, work / "ours", package, test)
        print(f"ours: {ours['wall_s']:.1f} s, rounds {json.dumps(ours['rounds'])}")
    if args.only:
        return
    a, b = summary(ours), summary(flower)
    print("")
    print(f"{'round':>5}  {'ours acc.':>9}  {'Flower acc.':>11}  {'ours round s':>12}  {'Flower round s':>14}  {'ours overhead s':>15}  {'Flower overhead s':>17}")
    for r, f in zip(ours["rounds"], flower["rounds"], strict=False):
        acc = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
        print(f"{r['round']:>5}  {acc(r['accuracy']):>9}  {acc(f['accuracy']):>11}  {r['round_s']:>12.3f}  {f['round_s']:>14.3f}  {r['overhead_s']:>15.3f}  {f['overhead_s']:>17.3f}")
    print("")
    for key, label in (("wall_s", "total wall time (s)"), ("round_s", "mean round time (s)"), ("overhead_s", "mean round overhead (s)"), ("slowest_fit_s", "mean slowest fit (s)")):
        print(f"{label:<26} ours {a[key]:8.3f}  Flower {b[key]:8.3f}  ours / Flower {a[key] / b[key]:.2f}")
    print(f"final accuracy             ours {100 * a['final_accuracy']:.2f}%  Flower {100 * b['final_accuracy']:.2f}%  "
          f"difference {100 * (a['final_accuracy'] - b['final_accuracy']):+.2f} points")  # fmt: skip
    if args.out:
        machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
        Path(args.out).write_text(json.dumps({"config": vars(args) | {"algorithm_config": CONFIG}, "ours": ours, "flower": flower,
                                              "summary": {"ours": a, "flower": b}, "machine": machine}, indent=2))  # fmt: skip
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
