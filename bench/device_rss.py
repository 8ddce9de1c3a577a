#!/usr/bin/env python3
"""Memory of an idle device agent: one :class:`device.agent.Device`, connected, heartbeating, nothing else.

What runs, all on 127.0.0.1:

* the broker: ``aisynergy broker run`` (Mosquitto, mutual TLS, per-identity ACL), as in production; it
  makes the hub CA in its data directory;
* one device agent in its own process. Its identity is made the way enrolment makes it, without a hub:
  :class:`device.identity.IdentityStore` makes the key and the CSR, the broker's CA
  (``cloud.pki.CertificateAuthority``) signs it, and the store saves the answer with a pinned Ed25519
  signing key, so the agent starts from a stored identity as it does on every start after the first.
  ``--entry sdk`` (the default): a small program that embeds ``Device(device_id, data_dir)``, ``start()``
  and waits; ``--entry cli``: ``python -m device.cli run``; ``--entry aisynergy``: ``aisynergy device run`` (the
  console script's root command, which finds ``device`` among its entry points).

The agent connects, subscribes, publishes ``online`` and heartbeats every ``--heartbeat`` seconds (10 s, the
hub's default). ``--seconds`` (60) after it logged ``connected``, this script reads its RSS and USS
(``psutil.Process.memory_full_info``), then asks it to write ``sys.modules`` (a line on its stdin) and stops
it with SIGTERM. Reported: RSS, USS, PSS in MiB, the number of modules, the heavy packages loaded (see
``HEAVY``) and every top-level package.

``imports``: where the memory goes before anything runs. A fresh interpreter imports, step by step, what every
agent needs (TLS, SQLite, paho-mqtt, pydantic, then the wire contract module by module, then ``device.agent``);
RSS and USS after each step, cumulative.

Usage::

    python bench/device_rss.py [--seconds 60] [--heartbeat 10] [--entry sdk|cli|aisynergy] [--out bench/results/device-rss.json]

Exit status: 0 measured (``--max-rss-mib``, when given, held), 3 measured but above ``--max-rss-mib``, 1 failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from tests.support import start_broker, stop  # noqa: E402

# Packages an idle agent has no use for: each is needed only by a model, an update, a task or an enrolment.
HEAVY = (
    "numpy", "onnxruntime", "safetensors", "cryptography", "httpx", "httpcore", "anyio", "h11", "click",
    "bsdiff4", "ai_edge_litert", "tflite_runtime", "torch", "scipy",
    "device.ota.updater", "device.ota.firmware", "device.ota.verify", "device.ota.download",
    "device.tasks.worker", "device.tasks.programs", "device.training", "device.tensors", "device.runtime",
    "interfaces.aggregation", "interfaces.secagg",
)  # fmt: skip

# The agent's process. A daemon thread waits for a line on stdin and then writes the modules loaded, so the
# listing is taken after the measurement and does not disturb it.
PRELUDE = """
import json, sys, threading
def _dump(path=sys.argv[1]):
    sys.stdin.readline()
    with open(path, "w") as f:
        json.dump(sorted(sys.modules), f)
threading.Thread(target=_dump, daemon=True).start()
del sys.argv[1]
"""
SDK_ENTRY = PRELUDE + """
import logging
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
from device import Device
dev = Device(sys.argv[1], sys.argv[2])
dev.run_forever()
"""
CLI_ENTRY = PRELUDE + """
import runpy
sys.argv[0] = "device.cli"
runpy.run_module("device.cli", run_name="__main__", alter_sys=True)
"""
AISYNERGY_ENTRY = PRELUDE + """
from cloud.cli.root import main
sys.argv[0] = "aisynergy"
main()
"""


# What every agent imports, in dependency order (a step's modules are imported together).
IMPORT_STEPS = (
    "ssl sqlite3 paho.mqtt.client", "pydantic", "interfaces.text interfaces.strict", "interfaces.deployments",
    "interfaces.resources interfaces.privacy", "interfaces.tasks", "interfaces.messages", "interfaces.infer interfaces.topics",
    "device.agent",
)  # fmt: skip
IMPORTS_ENTRY = """
import json, sys, psutil
steps = []
def step(what):
    m = psutil.Process().memory_full_info()
    steps.append({"after": what, "rss_mib": round(m.rss / 2**20, 1), "uss_mib": round(m.uss / 2**20, 1), "modules": len(sys.modules)})
step("python + psutil")
for group in json.loads(sys.argv[1]):
    for name in group.split():
        __import__(name)
    step(group)
print(json.dumps(steps))
"""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def make_identity(broker_dir: Path, data_dir: Path, device_id: str, mqtt_url: str, heartbeat_s: float) -> None:
    """A stored device identity signed by the broker's CA, as enrolment leaves it (signing key pinned)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from cloud.pki import CertificateAuthority
    from device.identity import IdentityStore
    from interfaces.nodes import DeviceCertificateIssued

    ca = CertificateAuthority.load_or_create(broker_dir / "pki")
    store = IdentityStore(data_dir)
    issued = ca.sign_csr(store.make_csr(device_id), device_id)
    signing = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    answer = DeviceCertificateIssued(
        device_id=device_id, node_id="nd-bench", certificate_pem=issued.certificate_pem, ca_pem=ca.ca_pem,
        serial=issued.serial, not_after=issued.not_after, mqtt_url=mqtt_url, heartbeat_interval_s=heartbeat_s,
        signing_key_pem=signing.decode(),
    )  # fmt: skip
    store.save(answer, "http://edge.invalid:8000")


def agent_command(entry: str, modules_file: Path, device_id: str, data_dir: Path) -> list[str]:
    if entry == "sdk":
        return [sys.executable, "-c", SDK_ENTRY, str(modules_file), device_id, str(data_dir)]
    run = ["run", "--device-id", device_id, "--data-dir", str(data_dir)]
    if entry == "cli":
        return [sys.executable, "-c", CLI_ENTRY, str(modules_file), *run]
    return [sys.executable, "-c", AISYNERGY_ENTRY, str(modules_file), "device", *run]


def wait_connected(proc: subprocess.Popen[bytes], log_file: Path, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited ({proc.returncode}): {log_file.read_text()[-3000:]}")
        if "connected to 127.0.0.1" in log_file.read_text():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise RuntimeError(f"the agent did not connect within {timeout_s} s: {log_file.read_text()[-3000:]}")


def import_steps(env: dict[str, str], work: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_ENTRY, json.dumps(IMPORT_STEPS)], env=env, cwd=work, capture_output=True, text=True, check=True
    )
    steps: list[dict[str, Any]] = json.loads(done.stdout)
    return steps


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def measure(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    broker = start_broker(work / "broker")
    try:
        device_id, data_dir = "dv-rss-bench", work / "device"
        make_identity(work / "broker", data_dir, device_id, broker.url, a.heartbeat)
        modules_file, log_file = work / "modules.json", work / "agent.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        imports = import_steps(env, work)
        with log_file.open("wb") as out:
            proc = subprocess.Popen(
                agent_command(a.entry, modules_file, device_id, data_dir), stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True,
            )  # fmt: skip
        try:
            connect_s = wait_connected(proc, log_file, 60)
            log(f"agent {proc.pid} connected after {connect_s:.1f} s; idle for {a.seconds:g} s")
            time.sleep(a.seconds)
            p = psutil.Process(proc.pid)
            mem, cpu = p.memory_full_info(), p.cpu_times()
            assert proc.stdin is not None
            proc.stdin.write(b"dump\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 10
            while not modules_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # the file is written in one go; let it close
            modules: list[str] = json.loads(modules_file.read_text())
            connections = log_file.read_text().count("connected to 127.0.0.1")
        finally:
            stop(proc)  # type: ignore[arg-type]
    finally:
        stop(broker.proc)
    loaded = set(modules)
    return {
        "entry": a.entry,
        "idle_s": a.seconds,
        "heartbeat_interval_s": a.heartbeat,
        "connect_s": round(connect_s, 2),
        "connections": connections,  # 1: no reconnect during the window
        "rss_mib": mib(mem.rss),
        "uss_mib": mib(mem.uss),
        "pss_mib": mib(mem.pss),
        "cpu_s": round(cpu.user + cpu.system, 2),
        "modules": len(modules),
        "heavy_loaded": [m for m in HEAVY if m in loaded],
        "top_level": sorted({m.split(".")[0] for m in modules if not m.startswith("_")}),
        "device_modules": sorted(m for m in modules if m.split(".")[0] in ("device", "interfaces")),
        "imports": imports,
    }


def machine() -> dict[str, Any]:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "")
    except OSError:
        pass
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"cpu": model, "cpus": os.cpu_count(), "python": sys.version.split()[0], "commit": git.stdout.strip()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60, help="idle seconds after the agent connected")
    p.add_argument("--heartbeat", type=float, default=10, help="heartbeat interval the enrolment gives (s)")
    p.add_argument("--entry", choices=("sdk", "cli", "aisynergy"), default="sdk",
                   help="embedded Device, python -m device.cli run, or aisynergy device run")
    p.add_argument("--max-rss-mib", type=float, help="exit 3 when the RSS is above this")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, identity)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the finally blocks stop the broker and the agent
    work = Path(tempfile.mkdtemp(prefix="device-rss-"))
    try:
        result = {"when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine(), **measure(a, work)}
    except Exception as exc:  # noqa: BLE001 - one line and exit 1
        log(f"failed: {exc}")
        return 1
    finally:
        if a.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    summary = {k: v for k, v in result.items() if k not in ("top_level", "device_modules", "imports")}
    print(json.dumps(summary, indent=2))
    for s in result["imports"]:
        log(f"imports: {s['rss_mib']:5.1f} MiB RSS {s['uss_mib']:5.1f} MiB USS {s['modules']:4d} modules after {s['after']}")
    log(f"top-level packages: {', '.join(result['top_level'])}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    if a.max_rss_mib is not None and result["rss_mib"] > a.max_rss_mib:
        log(f"RSS {result['rss_mib']} MiB is above {a.max_rss_mib} MiB")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
