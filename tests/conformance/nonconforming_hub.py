"""A hub deliberately out of spec, for the conformance suite's own test: it marks a silent node OFFLINE
only after ``--offline-after-missed`` heartbeats, a number the hub's settings refuse (the documented
maximum is 10). Settings are built without validation; nothing else differs from ``aisynergy hub serve``.

    python -m tests.conformance.nonconforming_hub --data-dir D --port P --broker-url mqtts://... --offline-after-missed 100000
"""

from __future__ import annotations

import argparse
from pathlib import Path

import uvicorn

from cloud.api.app import create_app
from cloud.config import Settings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--broker-url", required=True)
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--offline-after-missed", type=int, required=True)
    args = parser.parse_args()
    valid = Settings(data_dir=args.data_dir, broker_url=args.broker_url, heartbeat_interval_s=args.heartbeat_interval, liveness_check_interval_s=0.2)
    settings = Settings.model_construct(**{**valid.model_dump(), "offline_after_missed": args.offline_after_missed})
    uvicorn.run(create_app(settings), host="127.0.0.1", port=args.port, log_level="info")


if __name__ == "__main__":
    main()
