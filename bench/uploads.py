"""Chunked upload (``/artifacts/uploads``, device/upload.py) vs one plain ``POST /artifacts`` of the same file,
on loopback HTTP to a hub in this process (uvicorn, SQLite), run by hand:

    .venv/bin/python bench/uploads.py --mb 200 --runs 3

Each run uploads the same random file both ways under new versions (so each stores it: the blob store keeps one
copy by SHA-256, the artefact rows are new); MB/s = size / wall time of the whole upload (hashing the file, the
session, the chunks, the commit for the chunked one; the multipart body for the plain one). Prints one JSON
document; the figures are in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx
import uvicorn
from sqlmodel import Session

from cloud.api.app import create_app
from cloud.api.state import hub_state
from cloud.auth import create_api_token
from cloud.config import Settings
from device.upload import upload_artifact
from interfaces import API_PREFIX
from interfaces.auth import Role


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
        settings = Settings(data_dir=root / "hub", database_url=f"sqlite:///{root / 'hub.db'}", enable_mqtt=False,
                            max_artifact_bytes=4 * args.mb << 20)  # fmt: skip
        app = create_app(settings)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=60))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        with Session(hub_state(app).engine) as session:
            _, token = create_api_token(session, Role.OPERATOR, name="bench")
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
        server.should_exit = True
        thread.join(30)
    result: dict[str, Any] = {
        "mb": args.mb, "runs": args.runs, "chunk_bytes": settings.upload_chunk_bytes,
        "plain_mb_s": [round(v, 1) for v in plain], "chunked_mb_s": [round(v, 1) for v in chunked],
        "plain_median_mb_s": round(statistics.median(plain), 1), "chunked_median_mb_s": round(statistics.median(chunked), 1),
        "ratio": round(statistics.median(chunked) / statistics.median(plain), 3),
    }  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
