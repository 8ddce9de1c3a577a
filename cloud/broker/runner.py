"""Run Mosquitto for the hub: install it if missing, write its files, reload it on revocations."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from cloud.broker.config import BrokerLayout, read_devices, read_revoked, render_acl, render_config
from cloud.pki import CertificateAuthority

log = logging.getLogger("aisynergy.broker")

_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto")


class BrokerError(RuntimeError):
    pass


def find_mosquitto() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    return next((c for c in _CANDIDATES if os.access(c, os.X_OK)), None)


def ensure_mosquitto(install: bool = True) -> str:
    """Return the mosquitto binary, installing Debian's package when allowed and possible."""
    found = find_mosquitto()
    if found:
        return found
    if not install:
        raise BrokerError("mosquitto is not installed (apt-get install mosquitto)")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise BrokerError("mosquitto is not installed and cannot be installed here: run `apt-get install mosquitto` as root")
    log.info("installing mosquitto with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "mosquitto"], check=True, env=env)
    found = find_mosquitto()
    if not found:
        raise BrokerError("apt-get installed mosquitto but the binary was not found")
    return found


def prepare(layout: BrokerLayout, host: str, port: int, extra_hosts: tuple[str, ...] = ()) -> None:
    """Create the PKI (if missing), the broker's config and ACL."""
    hosts = tuple(h for h in {host, *extra_hosts} if h not in ("0.0.0.0", "::", ""))
    CertificateAuthority.load_or_create(layout.pki_dir, broker_hosts=hosts)
    layout.broker_dir.mkdir(parents=True, exist_ok=True)
    layout.persistence_dir.mkdir(parents=True, exist_ok=True)
    write_acl(layout)
    layout.config_file.write_text(render_config(layout, host, port))


def write_acl(layout: BrokerLayout) -> None:
    tmp = layout.acl_file.with_suffix(".tmp")
    tmp.write_text(render_acl(read_revoked(layout), read_devices(layout)))
    os.replace(tmp, layout.acl_file)


def _stamp(layout: BrokerLayout) -> tuple[float, ...]:
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime_ns
        except FileNotFoundError:
            return 0.0

    return mtime(layout.revoked_file), mtime(layout.crl_file), mtime(layout.devices_file)


def run(layout: BrokerLayout, host: str, port: int, extra_hosts: tuple[str, ...] = (), poll_s: float = 0.5) -> int:
    """Run mosquitto in the foreground until it exits or we are signalled; returns its exit code.

    When the hub revokes an identity (``revoked.txt`` / ``crl.pem`` change), rewrite the ACL and send
    SIGHUP: mosquitto reloads the ACL (open connections of the revoked identity are denied everything)
    and the CRL (new connections with the revoked certificate fail the TLS handshake).
    """
    binary = ensure_mosquitto()
    prepare(layout, host, port, extra_hosts)
    log.info("starting %s on %s:%d (config %s)", binary, host, port, layout.config_file)
    proc = subprocess.Popen([binary, "-c", str(layout.config_file)])
    stopping = False

    def _stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    seen = _stamp(layout)
    while proc.poll() is None:
        time.sleep(poll_s)
        now = _stamp(layout)
        if now != seen and not stopping:
            seen = now
            write_acl(layout)
            log.info("access changed: %d revoked identities, %d devices; reloading broker", len(read_revoked(layout)), len(read_devices(layout)))
            proc.send_signal(signal.SIGHUP)
    code = proc.wait()
    return 0 if stopping else code
