"""Many nodes enrolling at once: every one gets its certificate, and the broker is not reloaded for it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from cloud.pki import make_csr, new_private_key
from tests.support import free_port, start_hub, stop


def test_concurrent_enrolments_all_succeed_and_leave_the_revocation_files_alone(tmp_path: Path, sqlite_url: str) -> None:
    # Prepare: a hub (no broker needed for enrolment) and 24 registered nodes
    hub = start_hub(tmp_path / "stack", sqlite_url, f"mqtts://127.0.0.1:{free_port()}", wait_mqtt=False)
    try:
        with hub.client("operator") as api:
            nodes = [api.post("/nodes", json={"name": f"gw-{i}"}).json() for i in range(24)]
        crl = tmp_path / "stack" / "pki" / "crl.pem"
        crl_before = crl.read_bytes()

        def enrol(reg: dict) -> int:
            node_id = reg["node"]["id"]
            body = {"csr_pem": make_csr(new_private_key(), node_id), "bootstrap_token": reg["bootstrap_token"]}
            return httpx.post(f"{hub.url}/api/v1/nodes/{node_id}/certificate", json=body, timeout=30).status_code

        # Execute: 8 at a time
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(enrol, nodes))

        # Assert
        assert codes == [201] * len(nodes)
        assert crl.read_bytes() == crl_before  # nothing was revoked: no reason for the broker to reload
        assert not [p for p in (tmp_path / "stack" / "pki").iterdir() if p.name.startswith(".")]  # no temporary file left
    finally:
        stop(hub.proc)
