"""Chunked upload (``/artifacts/uploads``, device/upload.py) vs one plain ``POST /artifacts`` of the same file,
on loopback HTTP to a hub in its own process (``aisynergy hub serve --no-tls``, SQLite, no broker), run by hand:

    .venv/bin/python bench/uploads.py --mb 200 --runs 3

The client and the hub are separate processes, as a site and its hub are. Each run uploads the same random file
both ways under new versions (so each stores it: the blob store keeps one copy by SHA-256, the artefact rows are
new); MB/s = size / wall time of the whole upload (the session, the chunks with their hashing, the commit for the
chunked one; the multipart body for the plain one, whose client hashes nothing). Prints one JSON document; the
figures are in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx

from device.upload import upload_artifact
from interfaces import API_PREFIX

CLI = [sys.executable, "-m", "cloud.cli.root"]
CHUNK_BYTES = 8 * 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        data_dir, database_url, port = root / "hub", f"sqlite:///{root / 'hub.db'}", _free_port()
        data_dir.mkdir()
        env = {**os.environ, "AISYNERGY_ENABLE_MQTT": "false", "AISYNERGY_MAX_ARTIFACT_BYTES": str(4 * args.mb << 20),
               "AISYNERGY_UPLOAD_CHUNK_BYTES": str(CHUNK_BYTES)}  # fmt: skip
        with (root / "hub.log").open("wb") as log:
            hub = subprocess.Popen([*CLI, "hub", "serve", "--port", str(port), "--data-dir", str(data_dir), "--database-url", database_url, "--no-tls"],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if hub.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the hub did not start:\n" + (root / "hub.log").read_text()[-3000:])
                time.sleep(0.2)
            token = subprocess.run([*CLI, "hub", "token", "create", "--role", "operator", "--data-dir", str(data_dir), "--database-url", database_url],
                                   env=env, check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip().splitlines()[-1]  # fmt: skip
            source = root / "model.bin"
            with source.open("wb") as f:
                for _ in range(args.mb):
                    f.write(os.urandom(1 << 20))
            size = source.stat().st_size
            plain: list[float] = []
            chunked: list[float] = []
            for run in range(args.runs):
                started = time.perf_counter()
                with httpx.Client(base_url=url + API_PREFIX, timeout=600) as client, source.open("rb") as stream:
                    r = client.post("/artifacts", headers={"Authorization": f"Bearer {token}"},
                                    data={"kind": "model", "name": "plain", "version": f"1.0.{run}", "format": "bin"},
                                    files={"file": ("model.bin", stream, "application/octet-stream")})  # fmt: skip
                assert r.status_code == 201, r.text
                plain.append(size / (1 << 20) / (time.perf_counter() - started))
                started = time.perf_counter()
                upload_artifact(url, token, source, kind="model", name="chunked", version=f"1.0.{run}", format="bin", state_file=root / "state.json")
                chunked.append(size / (1 << 20) / (time.perf_counter() - started))
        finally:
            hub.terminate()
            hub.wait(30)
    result: dict[str, Any] = {
        "mb": args.mb, "runs": args.runs, "chunk_bytes": CHUNK_BYTES,
        "plain_mb_s": [round(v, 1) for v in plain], "chunked_mb_s": [round(v, 1) for v in chunked],
        "plain_median_mb_s": round(statistics.median(plain), 1), "chunked_median_mb_s": round(statistics.median(chunked), 1),
        "ratio": round(statistics.median(chunked) / statistics.median(plain), 3),
    }  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
