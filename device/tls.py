"""TLS for the agents' HTTP clients: one default context per process.

Building a default context loads the system CA bundle: about 25 ms of CPU on a server core, far more
on a small board, and more than the whole check of an artefact. Enrolment, artefact downloads and an
edge's proxying for its devices all make short-lived ``httpx`` clients, so they share this one.

After enrolment an agent checks the servers it talks to (its edge's listener, the hub) against the hub CA it
stored, and against the system's CAs (a hub may serve a certificate its operator got elsewhere):
:func:`agent_context`, one per CA file and process. ``server_name`` is the name that server's certificate carries
when it is not the URL's host (an edge's listener presents its node certificate, named by the node id): httpx
takes it per request, as the ``sni_hostname`` extension (:func:`server_name_extension`).
"""

from __future__ import annotations

import ssl
import threading
from pathlib import Path
from typing import Any

import httpx

_DEFAULT: ssl.SSLContext | None = None
_AGENT: dict[Path, ssl.SSLContext] = {}
_LOCK = threading.Lock()


def tls_verify(verify: str | bool | ssl.SSLContext = True) -> str | bool | ssl.SSLContext:
    """What to pass as ``httpx.Client(verify=...)``: the shared default context for ``True``, else ``verify``
    itself (a CA bundle path, a context of the caller's, or ``False``)."""
    global _DEFAULT
    if verify is not True:
        return verify
    with _LOCK:
        if _DEFAULT is None:
            _DEFAULT = httpx.create_ssl_context()
        return _DEFAULT


def hub_ca_context(*, cafile: Path | None = None, cadata: str | None = None) -> ssl.SSLContext:
    """A client context trusting the hub CA (a file, or PEM text) and the system's CAs (a hub may serve a
    certificate its operator got elsewhere), TLS 1.2 at least."""
    context = ssl.create_default_context(cafile=None if cafile is None else str(cafile), cadata=cadata)
    context.load_default_certs()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def agent_context(ca_path: Path | str) -> ssl.SSLContext:
    """:func:`hub_ca_context` for the hub CA in ``ca_path``; one per file and process."""
    path = Path(ca_path).resolve()
    with _LOCK:
        context = _AGENT.get(path)
        if context is None:
            context = _AGENT[path] = hub_ca_context(cafile=path)
        return context


def server_name_extension(server_name: str | None) -> dict[str, Any]:
    """The ``extensions`` of an httpx request to a server whose certificate names ``server_name`` (none: the URL's host)."""
    return {"sni_hostname": server_name} if server_name else {}
