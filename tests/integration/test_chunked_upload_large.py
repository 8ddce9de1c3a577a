"""A 300 MB artefact published through the chunked upload API by the site's client (device/upload.py) over a
link that is cut twice in the middle of a chunk: the upload resumes, the hub stores bytes that verify against the
signed manifest, and the hub process's memory stays within 100 MB of its idle figure throughout (chunks and the
commit are streamed, never held whole). The hub runs in its own process; the link is a TCP proxy in this test that
drops both sides of the connection after a given number of bytes sent towards the hub."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from device.ota.verify import load_public_key, verify_manifest
from device.upload import upload_artifact
from tests.support import AISYNERGY, Hub, create_token, free_port, logs_on_failure, start, stop, wait_for

SIZE = 300 * 1024 * 1024
CUTS = [90_000_000, 190_000_000]  # bytes towards the hub; neither a multiple of the 8 MiB chunk: mid-chunk
RSS_ALLOWANCE = 100 * 1024 * 1024


class CuttingProxy:
    """Forwards 127.0.0.1:port to the hub; once the bytes sent towards the hub pass the next of ``cut_after``, it
    closes both sides of that connection at once (a dropped link, mid-request)."""

    def __init__(self, target_port: int, cut_after: list[int]) -> None:
        self.target_port, self.cut_after = target_port, list(cut_after)
        self.upstream, self.cuts = 0, 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            pair = (client, upstream)
            threading.Thread(target=self._pump, args=(client, upstream, pair, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, pair, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, socket.socket], towards_hub: bool) -> None:
        try:
            while data := src.recv(256 * 1024):
                if towards_hub:
                    with self._lock:
                        self.upstream += len(data)
                        cut = bool(self.cut_after) and self.upstream >= self.cut_after[0]
                        if cut:
                            self.cut_after.pop(0)
                            self.cuts += 1
                    if cut:
                        for s in pair:
                            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                            s.close()
                        return
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in pair:
                s.close()

    def close(self) -> None:
        self._server.close()


class RssSampler:
    """The hub process's resident memory, sampled from a thread until stopped."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return sum(p.memory_info().rss for p in [self.process, *self.process.children(recursive=True)])

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(0.05)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    data_dir, port = tmp_path / "hub", free_port()
    data_dir.mkdir()
    database_url = f"sqlite:///{data_dir / 'hub.db'}"
    args = [*AISYNERGY, "hub", "serve", "--port", str(port), "--data-dir", str(data_dir), "--database-url", database_url, "--no-tls"]
    proc = start(args, data_dir / "hub.log", env={"AISYNERGY_ENABLE_MQTT": "false"})
    h = Hub(data_dir, port, database_url, proc, args=args)
    try:
        wait_for(lambda: h.health() or proc.poll() is not None, 120, what="hub health")
        assert proc.poll() is None, (data_dir / "hub.log").read_text()[-3000:]
        h.tokens["operator"] = create_token(data_dir, database_url, "operator")
        yield h
    finally:
        stop(h.proc)


def _random_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("wb") as f:
        for _ in range(size // (1024 * 1024)):
            data = os.urandom(1024 * 1024)
            digest.update(data)
            f.write(data)
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@pytest.mark.timeout(1800)  # a minute or two here; a busy 2-core machine may take many times that
def test_a_300_mb_upload_survives_two_cuts_mid_chunk_with_the_hubs_memory_flat(hub: Hub, tmp_path: Path) -> None:
    # Prepare
    source = tmp_path / "model.onnx"
    sha256 = _random_file(source, SIZE)
    proxy = CuttingProxy(hub.port, CUTS)
    with hub.client("operator") as api:
        assert api.get("/artifacts").status_code == 200  # the routes' code is loaded before the idle figure
    sampler = RssSampler(hub.proc.pid)
    time.sleep(1)
    idle = max(sampler.rss() for _ in range(5))

    # Execute
    started = time.monotonic()
    with logs_on_failure(hub.data_dir / "hub.log"), sampler:
        artifact = upload_artifact(
            f"http://127.0.0.1:{proxy.port}", hub.tokens["operator"], source, kind="model", name="site-model", version="3.0.0",
            format="onnx", state_file=tmp_path / "upload.json", timeout_s=600,
        )  # fmt: skip
    took = time.monotonic() - started
    proxy.close()

    # Assert
    print(f"300 MB chunked upload: {took:.1f} s; hub RSS idle {idle / 2**20:.1f} MiB, peak {sampler.peak / 2**20:.1f} MiB")
    assert proxy.cuts == 2, proxy.upstream
    assert (artifact.sha256, artifact.size) == (sha256, SIZE)
    blob = hub.data_dir / "artifacts" / sha256[:2] / sha256[2:]
    assert _file_sha256(blob) == sha256
    key = load_public_key(httpx.get(hub.url + "/api/v1/signing-key.pub", timeout=30).content)
    verify_manifest(key, artifact.signed_manifest)
    assert sampler.peak - idle < RSS_ALLOWANCE, (idle, sampler.peak)
    assert not (tmp_path / "upload.json").exists()
    assert list((hub.data_dir / "uploads").iterdir()) == []
