"""A device process for the store-and-forward tests: ``tick`` events at a steady rate, each seq recorded once
:meth:`device.agent.Device.emit` has returned (so a test knows what the device promised to deliver).

    python -m tests.integration.emitter --device-id D --data-dir DIR --record FILE --rate 5 \
        [--enrol-url URL --bootstrap-token T --ca-sha256 H --tls-server-name NODE]

SIGTERM or SIGINT: stop emitting and stop the device cleanly. SIGKILL: the test's power cut.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from device.agent import Device
from device.errors import OutboxFull


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device-id", required=True)
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--record", required=True, type=Path)
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--enrol-url")
    parser.add_argument("--bootstrap-token")
    parser.add_argument("--ca-sha256")
    parser.add_argument("--tls-server-name")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    device = Device(args.device_id, args.data_dir, enrol_url=args.enrol_url, bootstrap_token=args.bootstrap_token,
                    ca_sha256=args.ca_sha256, tls_server_name=args.tls_server_name)  # fmt: skip
    device.start()
    n = 0
    with args.record.open("a") as record:
        while not stop.wait(1 / args.rate):
            try:
                seq = device.emit("tick", {"n": n})
            except OutboxFull as exc:
                logging.error("not emitted: %s", exc)
                continue
            record.write(f"{seq}\n")
            record.flush()
            n += 1
    device.stop()


if __name__ == "__main__":
    main()
