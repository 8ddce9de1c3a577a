"""The site runtime (device/algorithm/runtime.py, device/algorithm/runner.py): a user's algorithm in a limited process
of its own. A run ends with its result, or FAILS with what happened (it raised, with the last lines of its traceback;
it broke the client API; it ran past its memory limit or its timeout; it wrote outside its directory; it died), and
a worker that fails leaves the others and the calling process unharmed. A run that is stopped resumes from its
last checkpoint. The limits are checked both ways this machine allows: cgroups where it lets us create them, rlimits
otherwise."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device.algorithm import landlock
from device.algorithm.client import load_parameters
from device.algorithm.runner import Job
from device.algorithm.runtime import AlgorithmFailed, Finished, Limits, limit_support, run_worker
from tests.support import wait_for

BEHAVE = Path(__file__).resolve().parents[1] / "fixtures" / "algorithms" / "behave"
NUMPY_CNN = Path(__file__).resolve().parents[2] / "examples" / "algorithms" / "numpy_cnn"
LIMITS = Limits(cpu_cores=1, memory_bytes=768 << 20, timeout_s=120)
CGROUPS = pytest.param("cgroup", marks=pytest.mark.skipif(limit_support() != "cgroup", reason="this machine lets no process create cgroups"))


def job(mode: str = "train", steps: int = 3, **config: Any) -> Job:
    return Job(package_dir=str(BEHAVE), config={"mode": mode, **config}, steps=steps, checkpoint_every=config.pop("every", 1) if "every" in config else 1)


def run(tmp_path: Path, job: Job, limits: Limits = LIMITS, how: str = "cgroup", name: str = "w", **kwargs: Any) -> Finished:
    root = Path("/sys/fs/cgroup") if how == "cgroup" else tmp_path / "no-cgroups"
    return run_worker(f"{name}-{os.getpid()}-{tmp_path.name}", tmp_path / name, job, limits, cgroup_root=root, **kwargs)


@pytest.fixture(params=[CGROUPS, "rlimit"])
def how(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_run_trains_each_step_checkpoints_and_publishes_its_outputs(tmp_path: Path, how: str) -> None:
    # Prepare
    lines: list[tuple[str, str]] = []
    frames: list[dict[str, Any]] = []

    # Execute
    result = run(tmp_path, job(steps=3), how=how, on_log=lambda s, line: lines.append((s, line)), on_frame=frames.append)

    # Assert
    assert (result.steps, result.resumed_from, result.num_examples, result.metrics, result.limited_by) == (3, 0, 10, {"accuracy": 1.0}, how)
    assert result.loss == -12.0  # four weights, each fitted three times
    np.testing.assert_array_equal(load_parameters(result.parameters)["w"], np.full(4, 3, np.float32))
    assert result.onnx is None  # the test algorithm has no export
    assert [f["step"] for f in frames if f["type"] == "step"] == [1, 2, 3]
    assert [f["step"] for f in frames if f["type"] == "checkpoint"] == [1, 2, 3]
    assert ("stdout", "fit round 2") in lines and ("stderr", "to stderr") in lines


def test_the_worker_sees_only_its_own_environment_and_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    monkeypatch.setenv("AISYNERGY_TOKEN", "secret-operator-token")
    monkeypatch.setenv("MQTT_PASSWORD", "secret")
    lines: list[str] = []

    # Execute
    run(tmp_path, job("environment", steps=1), Limits(cpu_cores=2, accelerators=(1, 3)), how="rlimit", on_log=lambda s, line: lines.append(line))

    # Assert
    env = dict(item.split("=", 1) for item in next(line for line in lines if line.startswith("ENV ")).split()[1:])
    assert "secret" not in " ".join(lines)
    assert not any(k.startswith(("AISYNERGY_", "MQTT")) for k in env)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["OMP_NUM_THREADS"] == "2"
    assert env["HOME"] == str((tmp_path / "w").resolve())
    assert next(line for line in lines if line.startswith("CWD ")) == f"CWD {(tmp_path / 'w').resolve()}"


def test_no_accelerator_reserved_means_none_visible(tmp_path: Path) -> None:
    lines: list[str] = []

    run(tmp_path, job("environment", steps=1), Limits(), how="rlimit", on_log=lambda s, line: lines.append(line))

    env = dict(item.split("=", 1) for item in next(line for line in lines if line.startswith("ENV ")).split()[1:] if "=" in item)
    assert env.get("CUDA_VISIBLE_DEVICES", "") == ""
    assert any(line.startswith("ENV ") and "CUDA_VISIBLE_DEVICES=" in line for line in lines)


def test_a_stopped_run_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    # Prepare: stop it once step 3 was trained (checkpoints every 2 steps: the last one is step 2)
    stop = threading.Event()
    trained: list[int] = []

    def on_frame(frame: dict[str, Any]) -> None:
        if frame["type"] == "step":
            trained.append(frame["step"])
            if frame["step"] == 3:
                stop.set()

    first = Job(package_dir=str(BEHAVE), config={"mode": "train", "delay_s": 0.5}, steps=6, checkpoint_every=2)
    with pytest.raises(AlgorithmFailed) as stopped:
        run(tmp_path, first, how="rlimit", on_frame=on_frame, stop=stop)

    # Execute
    again: list[int] = []
    result = run(tmp_path, first, how="rlimit", on_frame=lambda f: again.append(f["step"]) if f["type"] == "step" else None)

    # Assert
    assert stopped.value.reason == "stopped"
    assert result.resumed_from == 2 and again == [3, 4, 5, 6]  # step 3 again: fewer repeated steps than the interval
    np.testing.assert_array_equal(load_parameters(result.parameters)["w"], np.full(4, 6, np.float32))  # no step counted twice


@pytest.mark.parametrize(
    ("mode", "reason", "says"),
    [
        ("raise", "raised", "ValueError: the labels do not fit the model"),
        ("contract", "contract", "fit returned other parameter names than it was given"),
        ("exit", "died", "exited with status 7"),
    ],
)
def test_an_algorithm_that_fails_says_why(tmp_path: Path, mode: str, reason: str, says: str) -> None:
    with pytest.raises(AlgorithmFailed) as failed:
        run(tmp_path, job(mode, at_step=2), how="rlimit")

    assert failed.value.reason == reason, failed.value
    assert says in str(failed.value), str(failed.value)
    if mode == "raise":
        assert "behave/client.py" in failed.value.tail and "raise ValueError" in failed.value.tail  # the last lines of its traceback


def test_a_write_outside_its_directory_is_refused_and_fails_the_run(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"

    with pytest.raises(AlgorithmFailed) as failed:
        run(tmp_path, job("write_outside", path=str(outside)), how="rlimit")

    assert failed.value.reason == "forbidden_write" and str(outside) in str(failed.value)
    assert not outside.exists()


def test_a_hanging_algorithm_is_killed_at_its_timeout(tmp_path: Path) -> None:
    with pytest.raises(AlgorithmFailed) as failed:
        run(tmp_path, job("hang"), Limits(timeout_s=3), how="rlimit")

    assert failed.value.reason == "timeout" and "timeout of 3 s" in str(failed.value)


def test_an_algorithm_beyond_its_memory_limit_is_killed_and_says_so(tmp_path: Path, how: str) -> None:
    with pytest.raises(AlgorithmFailed) as failed:
        run(tmp_path, job("memory"), Limits(memory_bytes=768 << 20, timeout_s=120), how=how)

    assert failed.value.reason == "memory", failed.value
    assert "memory limit of 768 MiB" in str(failed.value)


def test_a_failing_worker_leaves_the_others_and_this_process_unharmed(tmp_path: Path) -> None:
    # Prepare
    results: dict[str, Any] = {}

    def go(name: str, j: Job) -> None:
        try:
            results[name] = run(tmp_path, j, how="rlimit", name=name)
        except AlgorithmFailed as exc:
            results[name] = exc

    threads = [threading.Thread(target=go, args=("bad", job("memory"))), threading.Thread(target=go, args=("good", job(steps=4)))]

    # Execute
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

    # Assert
    assert isinstance(results["bad"], AlgorithmFailed) and results["bad"].reason == "memory"
    assert isinstance(results["good"], Finished) and results["good"].steps == 4


def test_the_numpy_example_trains_and_exports_onnx_in_the_runtime(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16).astype(np.float32).reshape(-1, 1, 8, 8), digits.target.astype(np.int64)
    np.savez(tmp_path / "train.npz", x=x[:1400], y=y[:1400])
    np.savez(tmp_path / "test.npz", x=x[1400:], y=y[1400:])
    j = Job(package_dir=str(NUMPY_CNN), datasets={"train": str(tmp_path / "train.npz"), "test": str(tmp_path / "test.npz")}, config={"epochs": 1}, steps=3)

    result = run(tmp_path, j, how="rlimit")

    assert result.onnx is not None
    session = ort.InferenceSession(str(result.onnx))
    logits = session.run(None, {session.get_inputs()[0].name: x[1400:]})[0]
    assert abs(float((logits.argmax(1) == y[1400:]).mean()) - result.metrics["accuracy"]) < 0.005


def test_paths_relative_to_the_agents_directory_reach_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: an agent started in tmp_path with a relative data directory (`edge run --data-dir .data/gw-3`)
    import shutil

    shutil.copytree(BEHAVE, tmp_path / "site" / "package")
    (tmp_path / "site" / "data.npz").write_bytes(b"rows")
    monkeypatch.chdir(tmp_path)
    j = Job(package_dir="site/package", datasets={"train": "site/data.npz"}, config={"mode": "train"}, steps=1)

    # Execute: the worker starts in its own directory, not the agent's
    result = run(tmp_path, j, how="rlimit")

    # Assert: it found its package (it trained) in spite of the relative paths
    assert result.steps == 1 and result.num_examples == 10


def _frozen(work: Path) -> bool:
    """Every process working in ``work`` is stopped (state T), and there is one."""
    states = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(work):
                states.append(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue
    return bool(states) and all(state == "T" for state in states)


def test_a_paused_run_takes_no_step_until_it_resumes_and_its_paused_time_is_not_running_time(tmp_path: Path) -> None:
    # Prepare: steps of 0.3 s under a 12 s timeout; paused after step 2, for longer than that timeout
    held = threading.Event()
    steps: list[int] = []

    def on_frame(frame: dict[str, Any]) -> None:
        if frame["type"] == "step":
            steps.append(frame["step"])
            if frame["step"] == 2:
                held.set()

    result: list[Finished] = []
    runner = threading.Thread(target=lambda: result.append(run(tmp_path, job(steps=5, delay_s=0.3), Limits(timeout_s=12), how="rlimit", on_frame=on_frame,
                                                               paused=held.is_set)))  # fmt: skip
    runner.start()
    wait_for(lambda: held.is_set() and _frozen((tmp_path / "w").resolve()), 120, what="the worker stopped")
    time.sleep(0.5)  # frames written before the stop are read by now

    # Execute
    during = list(steps)
    time.sleep(12.5)
    still = _frozen((tmp_path / "w").resolve())
    after_pause = list(steps)
    held.clear()
    runner.join(120)

    # Assert
    assert still and during == after_pause, (during, after_pause)
    assert result and result[0].steps == 5 and steps == [1, 2, 3, 4, 5]


LANDLOCK = landlock.abi_version()


@pytest.mark.skipif(LANDLOCK is None, reason="this kernel has no Landlock")
def test_a_native_write_outside_its_directory_is_refused_by_the_kernel(tmp_path: Path) -> None:
    # Prepare: libc's open(2) through ctypes, which no audit hook sees
    outside = tmp_path / "outside.txt"
    started: list[dict[str, Any]] = []

    # Execute
    with pytest.raises(AlgorithmFailed) as failed:
        run(tmp_path, job("write_outside_native", path=str(outside)), how="rlimit", on_frame=lambda f: started.append(f) if f["type"] == "started" else None)

    # Assert
    assert failed.value.reason == "raised" and "Permission denied" in str(failed.value), failed.value
    assert not outside.exists()
    assert started[0]["confinement"] == f"landlock abi {LANDLOCK}"


@pytest.mark.skipif(LANDLOCK is None or LANDLOCK < 4, reason="this kernel's Landlock has no network rules")
def test_an_algorithm_cannot_open_a_tcp_connection(tmp_path: Path) -> None:
    # Prepare: something listening on the loopback, as a hub or a broker would
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)

        # Execute
        with pytest.raises(AlgorithmFailed) as failed:
            run(tmp_path, job("connect", port=listener.getsockname()[1]), how="rlimit")
        try:
            accepted = listener.accept()[0]
            accepted.close()
            reached = True
        except TimeoutError:
            reached = False

    # Assert
    assert failed.value.reason == "raised" and "Permission denied" in str(failed.value), failed.value
    assert not reached



@pytest.mark.skipif(LANDLOCK is None, reason="this kernel has no Landlock")
@pytest.mark.parametrize(("what", "readable"), [("the agent's key", False), ("its dataset", True), ("another task's file", False)])
def test_nothing_of_the_agents_directory_is_readable_but_its_own(tmp_path: Path, what: str, readable: bool) -> None:
    # Prepare: an agent's data dir with its key, a dataset and another task's directory; the worker's inside it
    agent = tmp_path / "agent"
    (agent / "identity").mkdir(parents=True)
    (agent / "identity" / "node.key").write_text("-----BEGIN PRIVATE KEY-----")
    (agent / "datasets").mkdir()
    (agent / "datasets" / "digits.npz").write_bytes(b"x" * 100)
    (agent / "tasks" / "training" / "task-other").mkdir(parents=True)
    (agent / "tasks" / "training" / "task-other" / "checkpoint.bin").write_bytes(b"theirs")
    (tmp_path / "up").symlink_to(tmp_path)  # links beside it to what holds it, and into it: neither is a way in
    (tmp_path / "in").symlink_to(agent / "identity")
    work = agent / "tasks" / "training" / "task-1" / "work"
    target = {"the agent's key": agent / "identity" / "node.key", "its dataset": agent / "datasets" / "digits.npz",
              "another task's file": agent / "tasks" / "training" / "task-other" / "checkpoint.bin"}[what]  # fmt: skip
    lines: list[str] = []
    confined = Job(package_dir=str(BEHAVE), datasets={"train": str(agent / "datasets" / "digits.npz")}, config={"mode": "read", "path": str(target)},
                   steps=1, private_dir=str(agent))  # fmt: skip

    # Execute
    try:
        result: Finished | AlgorithmFailed = run_worker(f"r-{os.getpid()}-{tmp_path.name}", work, confined, LIMITS, cgroup_root=tmp_path / "no-cgroups",
                                                        on_log=lambda stream, line: lines.append(line))  # fmt: skip
    except AlgorithmFailed as exc:
        result = exc

    # Assert
    if readable:
        assert isinstance(result, Finished) and f"read 100 bytes of {target}" in lines, (result, lines)
    else:
        assert isinstance(result, AlgorithmFailed) and result.reason == "raised" and "Permission denied" in str(result), (result, lines)


def test_a_jobs_fit_config_reaches_every_fit_call(tmp_path: Path) -> None:
    """What a whole-model round adds to fit's config (server_round; proximal_mu for FedProx) gets to the algorithm:
    the numpy example with a large mu moves much less from the parameters it was given."""
    from safetensors.numpy import load_file, save_file
    from sklearn.datasets import load_digits

    digits = load_digits()
    np.savez(tmp_path / "train.npz", x=(digits.data[:300] / 16).astype(np.float32).reshape(-1, 1, 8, 8), y=digits.target[:300].astype(np.int64))
    sys.path.insert(0, str(NUMPY_CNN))
    try:
        from numpy_cnn.client import NumpyCNN
    finally:
        sys.path.remove(str(NUMPY_CNN))
    start = NumpyCNN({"seed": 0, "epochs": 1, "learning_rate": 0.05, "batch_size": 32}, {"train": tmp_path / "train.npz"}).initial_parameters()
    save_file(start, str(tmp_path / "start.safetensors"))
    moved = {}
    for mu in (0.0, 20.0):
        j = Job(package_dir=str(NUMPY_CNN), datasets={"train": str(tmp_path / "train.npz")}, config={"epochs": 1}, steps=1, export=False,
                initial_parameters=str(tmp_path / "start.safetensors"), fit_config={"server_round": 3, "proximal_mu": mu})  # fmt: skip
        result = run(tmp_path / f"mu{mu:g}", j, how="rlimit", name=f"w{mu:g}")
        trained = load_file(str(result.parameters))
        moved[mu] = float(np.sqrt(sum(float(((trained[k].astype(np.float64) - start[k]) ** 2).sum()) for k in start)))
    assert moved[20.0] < 0.5 * moved[0.0], moved
