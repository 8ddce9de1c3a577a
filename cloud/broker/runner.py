"""Run Mosquitto for the hub: install it if missing, write its files, reload it on revocations.

Started as root, Mosquitto runs as its own account (:data:`BROKER_ACCOUNT`, when it exists): the broker's
directory (its config, ACL, persistence and the copies of its TLS files) is handed to that account, 0700 and
0600, and Mosquitto drops to it once its listener is open. Its open-file limit is raised to the hard limit,
so it takes as many connections as the system allows it. ``share`` is the hub's side of a split deployment:
it copies only what the broker needs out of the hub's PKI (never the CA key or the signing key).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from cloud.broker.config import TLS_FILES, BrokerLayout, read_devices, read_revoked, render_acl, render_config
from cloud.pki import CertificateAuthority, key_matches_certificate

log = logging.getLogger("aisynergy.broker")

_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto")
BROKER_ACCOUNT = "mosquitto"  # Debian's package creates it; Mosquitto's own default for `user`
SHARED_FILES = (*TLS_FILES, "revoked.txt", "devices.txt")
"""What the broker needs of the hub's PKI directory: its TLS files and the access lists."""
NOFILE_CAP = 1 << 20  # an unlimited hard limit: the kernel's usual ceiling (fs.nr_open)
RESERVED_FILES = 16  # listener, persistence, log, config: what the broker keeps open besides connections
SHARE_WAIT_LOG_S = 30.0


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


def broker_account(layout: BrokerLayout) -> pwd.struct_passwd | None:
    """The account Mosquitto runs as: :data:`BROKER_ACCOUNT` when we are root, it exists and it can reach the
    broker's directory; ``None``: the current user (a non-root user stays itself)."""
    if os.geteuid() != 0:
        return None
    try:
        account = pwd.getpwnam(BROKER_ACCOUNT)
    except KeyError:
        log.warning("no user %r: the broker runs as root", BROKER_ACCOUNT)
        return None
    closed = _closed_parent(layout.broker_dir, account)
    if closed is not None:
        log.warning("the broker runs as root: %s is closed to user %r (it needs search permission on every parent "
                    "of %s; chmod o+x, or choose another --data-dir)", closed, BROKER_ACCOUNT, layout.broker_dir)  # fmt: skip
        return None
    return account


def _closed_parent(path: Path, account: pwd.struct_passwd) -> Path | None:
    """The first directory above ``path`` that ``account`` may not search (``None``: it reaches ``path``)."""
    groups = set(os.getgrouplist(account.pw_name, account.pw_gid))
    for parent in reversed(path.resolve().parents):
        try:
            st = parent.stat()
        except FileNotFoundError:
            continue  # made by prepare()
        if st.st_uid == account.pw_uid:
            searchable = st.st_mode & stat.S_IXUSR
        elif st.st_gid in groups:
            searchable = st.st_mode & stat.S_IXGRP
        else:
            searchable = st.st_mode & stat.S_IXOTH
        if not searchable:
            return parent
    return None


def _write(path: Path, data: bytes, account: pwd.struct_passwd | None) -> None:
    """Replace ``path`` atomically with a 0600 file owned by ``account`` (or by us)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o600)
            if account is not None:
                os.fchown(fh.fileno(), account.pw_uid, account.pw_gid)
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _own_dir(path: Path, account: pwd.struct_passwd | None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if account is not None:
        os.chown(path, account.pw_uid, account.pw_gid)
    os.chmod(path, 0o700)


def _copy_changed(src_dir: Path, dest_dir: Path, names: tuple[str, ...], account: pwd.struct_passwd | None) -> list[str]:
    """Copy each of ``names`` whose content differs (a file gone at the source goes); the names copied."""
    changed = []
    for name in names:
        src, dest = src_dir / name, dest_dir / name
        try:
            data = src.read_bytes()
        except FileNotFoundError:
            if dest.exists():
                dest.unlink()
                changed.append(name)
            continue
        try:
            same = dest.read_bytes() == data
        except FileNotFoundError:
            same = False
        if not same:
            _write(dest, data, account)
            changed.append(name)
    return changed


def missing_tls_files(layout: BrokerLayout) -> list[str]:
    return [name for name in TLS_FILES if not (layout.pki_dir / name).exists()]


def prepare(layout: BrokerLayout, host: str, port: int, extra_hosts: tuple[str, ...] = ()) -> pwd.struct_passwd | None:
    """Create the PKI (if missing and ours to create), the broker's config, ACL and copies of its TLS files, all
    owned by the account Mosquitto runs as; returns that account (``None``: the current user)."""
    if layout.owns_ca:
        hosts = tuple(h for h in {host, *extra_hosts} if h not in ("0.0.0.0", "::", ""))
        CertificateAuthority.load_or_create(layout.pki_dir, broker_hosts=hosts)
    elif missing := missing_tls_files(layout):
        raise BrokerError(f"{layout.pki_dir} lacks {', '.join(missing)}: `aisynergy broker share` writes them on the hub's side")
    layout.data_dir.mkdir(parents=True, exist_ok=True)
    account = broker_account(layout)
    _own_dir(layout.broker_dir, account)
    _own_dir(layout.persistence_dir, account)
    _own_dir(layout.tls_dir, account)
    for path in (layout.pid_file, *layout.persistence_dir.iterdir()):  # left by a broker that ran as root
        if account is not None and path.exists():
            os.chown(path, account.pw_uid, account.pw_gid)
    _copy_changed(layout.pki_dir, layout.tls_dir, TLS_FILES, account)
    write_acl(layout, account)
    _write(layout.config_file, render_config(layout, host, port, user=account.pw_name if account else None).encode(), account)
    return account


def write_acl(layout: BrokerLayout, account: pwd.struct_passwd | None = None) -> None:
    _write(layout.acl_file, render_acl(read_revoked(layout), read_devices(layout)).encode(), account)


def _stamp(directory: Path, names: tuple[str, ...]) -> tuple[int, ...]:
    def mtime(p: Path) -> int:
        try:
            return p.stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    return tuple(mtime(directory / name) for name in names)


def nofile_limit() -> int:
    """The open-file limit the broker gets: the hard limit (capped at :data:`NOFILE_CAP` when unlimited)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return NOFILE_CAP if hard == resource.RLIM_INFINITY else hard


def _raise_nofile() -> None:  # in the child, before exec: only async-signal-safe work
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile_limit(), hard))


class _Signals:
    def __init__(self) -> None:
        self.stopping = False
        self.on_stop: list[subprocess.Popen[bytes]] = []
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def _stop(self, _signum: int, _frame: object) -> None:
        self.stopping = True
        for proc in self.on_stop:
            proc.send_signal(signal.SIGTERM)


def _wait_for_share(layout: BrokerLayout, signals: _Signals, poll_s: float) -> bool:
    """Wait until the hub's side has written the broker's TLS files; ``False``: signalled first."""
    last_log = -SHARE_WAIT_LOG_S
    while missing := missing_tls_files(layout):
        if signals.stopping:
            return False
        if time.monotonic() - last_log >= SHARE_WAIT_LOG_S:
            last_log = time.monotonic()
            log.info("waiting for %s in %s (written by `aisynergy broker share`)", ", ".join(missing), layout.pki_dir)
        time.sleep(poll_s)
    return True


def _pair_complete(pki_dir: Path) -> bool:
    """The broker's key and certificate match: not half way through a rotation (which writes the key, then the
    certificate); until they do, nothing is copied and the broker keeps the pair it has."""
    if key_matches_certificate(pki_dir / "broker.crt", pki_dir / "broker.key"):
        return True
    log.info("the broker's key and certificate do not match yet (a rotation under way?): waiting")
    return False


def run(layout: BrokerLayout, host: str, port: int, extra_hosts: tuple[str, ...] = (), poll_s: float = 0.5) -> int:
    """Run mosquitto in the foreground until it exits or we are signalled; returns its exit code.

    When the hub revokes an identity or signs the CRL again (``revoked.txt`` / ``crl.pem`` change), or the
    devices an edge serves change, copy the new files into the broker's own directory, rewrite the ACL and send
    SIGHUP: mosquitto reloads the ACL (open connections of a revoked identity are denied everything), the
    CRL (new connections with a revoked certificate fail the TLS handshake) and its certificate (after
    ``aisynergy hub rotate broker-certificate``: new connections get the new one, open ones stay up).
    """
    binary = ensure_mosquitto()
    signals = _Signals()
    if not layout.owns_ca and not _wait_for_share(layout, signals, poll_s):
        return 0
    account = prepare(layout, host, port, extra_hosts)
    files = nofile_limit()
    log.info("starting %s on %s:%d as user %s (config %s); open-file limit %d: up to about %d connections", binary, host, port,
             account.pw_name if account else pwd.getpwuid(os.geteuid()).pw_name, layout.config_file, files, files - RESERVED_FILES)  # fmt: skip
    proc = subprocess.Popen([binary, "-c", str(layout.config_file)], preexec_fn=_raise_nofile)  # noqa: PLW1509 - one thread here
    signals.on_stop.append(proc)
    if signals.stopping:
        proc.send_signal(signal.SIGTERM)
    watched = (*SHARED_FILES,)
    seen = _stamp(layout.pki_dir, watched)
    while proc.poll() is None:
        time.sleep(poll_s)
        now = _stamp(layout.pki_dir, watched)
        if now != seen and not signals.stopping and _pair_complete(layout.pki_dir):
            seen = now
            copied = _copy_changed(layout.pki_dir, layout.tls_dir, TLS_FILES, account)
            write_acl(layout, account)
            log.info("access changed (%s): %d revoked identities, %d devices; reloading broker",
                     ", ".join(copied) or "access lists", len(read_revoked(layout)), len(read_devices(layout)))  # fmt: skip
            proc.send_signal(signal.SIGHUP)
    code = proc.wait()
    return 0 if signals.stopping else code


def share(pki_dir: Path, dest: Path, broker_hosts: tuple[str, ...] = (), poll_s: float = 0.5) -> int:
    """The hub's side of a split deployment: keep ``dest`` a copy of :data:`SHARED_FILES` of the hub's PKI (the
    broker's certificate and key, the CA certificate, the CRL, the access lists; 0600 in a 0700 directory),
    until signalled. The broker (``aisynergy broker run --pki-dir DEST``) never sees the CA or signing key."""
    hosts = tuple(h for h in broker_hosts if h not in ("0.0.0.0", "::", ""))
    CertificateAuthority.load_or_create(pki_dir, broker_hosts=hosts)
    _own_dir(dest, None)
    signals = _Signals()
    seen: tuple[int, ...] | None = None
    while not signals.stopping:
        now = _stamp(pki_dir, SHARED_FILES)
        if now != seen and _pair_complete(pki_dir):
            seen = now
            if copied := _copy_changed(pki_dir, dest, SHARED_FILES, None):
                log.info("shared with the broker: %s", ", ".join(copied))
        time.sleep(poll_s)
    return 0
