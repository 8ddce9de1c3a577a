"""TLS for the agents' HTTP clients: one default context per process.

Building a default context loads the system CA bundle: about 25 ms of CPU on a server core, far more
on a small board, and more than the whole check of an artefact. Enrolment, artefact downloads and an
edge's proxying for its devices all make short-lived ``httpx`` clients, so they share this one.
"""

from __future__ import annotations

import ssl
import threading

import httpx

_DEFAULT: ssl.SSLContext | None = None
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
