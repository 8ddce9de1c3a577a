"""Schemathesis hooks for fuzzing a live hub (``SCHEMATHESIS_HOOKS=tests.hub.fuzz_hooks``).

- Every non-empty ``Idempotency-Key`` is made unique to its request. Generated keys repeat ("0", "a", ...), and
  the same key with another request is refused (422 ``idempotency_key_reused``, as the Idempotency-Key draft
  asks): schemathesis cannot know that, and would report a valid request refused. Replays and reuse are tested
  in test_idempotency and test_api_idempotency_scope.
- Half of the generated path ids (chosen by a hash of the value: the same every run) are replaced by ids of rows
  seeded beforehand (``AISYNERGY_FUZZ_SEEDED``: a JSON object, parameter name -> ids), so that the generated
  requests reach real rows and not only 404s.
- A schema-valid case carries values only the hub can issue or a real key can make where the schema can only say
  "a string": a list ``cursor`` is one the hub issues (an opaque cursor it never issued is 400 invalid_cursor),
  ``csr_pem`` a real PKCS#10 request and ``certificate_pem`` a real certificate (anything else is 422
  csr_invalid / certificate_invalid). Negative cases keep what was generated.
- A schema-valid ``POST /tasks`` that names placement ``ids`` names seeded targets of its kind, so that tasks
  get made (see schemathesis.toml for what that operation's schema does not state yet).
- Dropped, as not the hub's fault: "schema-valid request rejected" for an integer within 1024 of a 64-bit bound.
  Schemathesis checks a value against the schema in 64-bit floating point, where every integer from 2**63 - 512
  to 2**63 + 1023 is 2**63, so it takes 9223372036854775999 for a value within ``maximum: 9223372036854775807``;
  the hub compares integers exactly and refuses it (422), as it should.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from typing import Any

import schemathesis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from schemathesis import GenerationMode

_SEEDED: dict[str, list[str]] = json.loads(os.environ.get("AISYNERGY_FUZZ_SEEDED", "{}"))
_sequence = itertools.count()
_VALID_KEY = re.compile(r"^[\x20-\x7e]{1,255}$")  # as the header is declared; an invalid one is left to be refused


def _pems() -> tuple[str, str]:
    """A CSR and a self-signed certificate of one new key (CN ``fuzz``)."""
    from datetime import UTC, datetime, timedelta

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fuzz")])
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + timedelta(days=1))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return csr.public_bytes(serialization.Encoding.PEM).decode(), cert.public_bytes(serialization.Encoding.PEM).decode()


_CSR_PEM, _CERT_PEM = _pems()
_PEMS = {"csr_pem": _CSR_PEM, "certificate_pem": _CERT_PEM}


def _positive(case: Any) -> bool:
    meta = getattr(case, "meta", None)
    return meta is not None and meta.generation.mode == GenerationMode.POSITIVE


def _issued_cursor(value: Any) -> str:
    """A cursor as the hub issues them: ``interfaces.pagination.encode_cursor`` of an id (a number: event logs
    page by a numeric id, other lists compare it as text)."""
    import base64

    return base64.urlsafe_b64encode(str(_digest(value)).encode()).decode().rstrip("=")


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:4], "big")


@schemathesis.hook
def map_path_parameters(context: Any, path_parameters: dict[str, Any]) -> dict[str, Any]:
    if not path_parameters:
        return path_parameters
    out = dict(path_parameters)
    for name, value in path_parameters.items():
        ids = _SEEDED.get(name)
        if ids and _digest(value) % 2 == 0:
            out[name] = ids[_digest((name, value)) % len(ids)]
    return out


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if _positive(case):
        if isinstance(case.query, dict) and isinstance(case.query.get("cursor"), str):
            case.query["cursor"] = _issued_cursor(case.query["cursor"])
        if isinstance(case.body, dict):
            for name, pem in _PEMS.items():
                if isinstance(case.body.get(name), str):
                    case.body[name] = pem
            placement = case.body.get("placement")
            if isinstance(placement, dict) and isinstance(placement.get("ids"), list):
                targets = _SEEDED.get("node_id" if placement.get("target") == "node" else "device_id", [])
                if targets:
                    placement["ids"] = targets[: max(1, min(len(placement["ids"]), len(targets)))]
    headers = case.headers or {}
    for name in list(headers):
        value = headers[name]
        if name.lower() == "idempotency-key" and isinstance(value, str) and _VALID_KEY.match(value):
            headers[name] = f"{value[:230]}.{os.getpid()}.{next(_sequence)}"  # unique across runs on one hub too


_NEAR_INT64 = 2**63 - 1024


def _value_at(case: Any, loc: list[str]) -> Any:
    where, *path = loc
    value = {"body": case.body, "query": case.query, "header": case.headers, "path": case.path_parameters}.get(where)
    for key in path:
        if isinstance(value, dict):
            value = value.get(key, next((v for k, v in value.items() if k.lower() == str(key).lower()), None))
        elif isinstance(value, list) and str(key).isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    if type(failure).__name__ != "RejectedPositiveData" or response.status_code != 422:
        return True
    try:
        errors = json.loads(response.text).get("errors") or []
    except ValueError:
        return True
    bounds = [e for e in errors if e.get("type") in ("less_than_equal", "greater_than_equal")]
    if not errors or len(bounds) != len(errors):
        return True
    for error in bounds:
        value = _value_at(case, [str(p) for p in error.get("loc", [])])
        try:
            number = int(value)
        except (TypeError, ValueError):
            return True
        if abs(number) < _NEAR_INT64:
            return True
    return False  # only integers a 64-bit float cannot tell from the bound: not a failure of the hub
