"""How an agent (a device, or an edge node) reaches its broker: the URL, mutual TLS, the reconnect delay, and what
it puts on the wire (:func:`encode`: an envelope, checked against the topic table)."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel

from device.errors import ConfigError
from interfaces.messages import envelope
from interfaces.reconnect import reconnect_delay  # one back-off for every agent (capped: see its module)
from interfaces.topics import Topic

MQTTS_DEFAULT_PORT = 8883


def parse_mqtt_url(url: str) -> tuple[str, int]:
    """``mqtts://host[:port]`` -> (host, port); a device only ever talks TLS."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number
        raise ConfigError(f"{url!r} is not an mqtts://host[:port] URL: {exc}") from None
    if parts.scheme not in ("mqtts", "ssl") or not parts.hostname:
        raise ConfigError(f"{url!r} is not an mqtts://host[:port] URL")
    return parts.hostname, port or MQTTS_DEFAULT_PORT


def tls_context(ca_path: Path, cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """Trust only the CA from enrolment, verify the broker's host name, present the device certificate."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_path))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert_path), str(key_path))
    return context


def is_tls_failure(reason: str, exc: BaseException | None = None) -> bool:
    """Whether a connection failure is the TLS handshake's (an ``ssl.SSLError`` behind ``exc``, or its words)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return any(word in reason for word in ("SSL", "certificate", "alert"))


def log_retry(
    logger: logging.Logger,
    where: str,
    reason: str,
    delay_s: float,
    *,
    detail: str | None = None,
    exc: BaseException | None = None,
    refused: str | None = None,
    prefix: str = "",
) -> None:
    """Say why an agent's connection failed and when it tries again, the same way at both tiers: ``detail`` is
    paho's own explanation (:meth:`PahoLog.take`), ``refused`` the client id a broker's CONNACK refused."""
    if detail:
        reason = f"{detail} ({reason})"
    if refused is not None:
        logger.error("%sbroker %s refused %s: %s; retrying in %.1f s", prefix, where, refused, reason, delay_s)
    elif is_tls_failure(reason, exc):
        logger.error("%sTLS with %s failed: %s; retrying in %.1f s", prefix, where, reason, delay_s)
    else:
        logger.warning("%sconnection to %s failed or lost: %s; retrying in %.1f s", prefix, where, reason, delay_s)


def encode(topic: Topic[Any], src: str, body: BaseModel, reply_to: str | None = None) -> bytes:
    """``body`` in a fresh envelope from ``src``, as the bytes that travel on ``topic``; ``TypeError`` when the
    topic table says another body travels there, ``ValueError`` when it cannot be serialised."""
    message = envelope(src, body, reply_to=reply_to)  # type: ignore[type-var]
    if not isinstance(message, topic.payload):
        raise TypeError(f"{type(body).__name__} does not travel on {topic.pattern}")
    return message.model_dump_json().encode()


__all__ = [
    "MQTTS_DEFAULT_PORT",
    "PahoLog",
    "encode",
    "is_tls_failure",
    "log_retry",
    "parse_mqtt_url",
    "reconnect_delay",
    "tls_context",
]


class PahoLog(logging.Filter):
    """Sits on paho's logger. Its error lines are kept and demoted to DEBUG: the agent logs the cause
    itself, with what it does next, when paho reports the failure (a TLS alert after the handshake, from
    a revoked or unknown certificate under TLS 1.3, reaches the callbacks only as a lost connection).
    paho 2.2's "Client is not connected", logged on every pass of its loop without a socket, is normal
    while waiting to reconnect and while stopping, and is not kept."""

    NOISE = "Client is not connected"

    def __init__(self) -> None:
        super().__init__()
        self.message: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        message = record.getMessage()
        if not message.startswith(self.NOISE):
            self.message = message
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)

    def take(self) -> str | None:
        message, self.message = self.message, None
        return message
