"""``aisynergy hub``: serve the hub, manage integrator tokens, migrate the database."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from interfaces.auth import Role

if TYPE_CHECKING:
    from sqlalchemy import Engine

TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"  # what the hub's HTTPS offers over TLS 1.2 (1.3 is preferred)

_data_dir = click.option("--data-dir", type=click.Path(path_type=Path), envvar="AISYNERGY_DATA_DIR", default=".data", show_default=True, help="PKI, default SQLite database")
_db = click.option("--database-url", envvar="AISYNERGY_DATABASE_URL", default=None, help="default: sqlite:///<data-dir>/hub.db; postgresql://... for PostgreSQL")


@click.group()
def hub() -> None:
    """The hub: REST API, MQTT bridge and controllers."""


@hub.command()
@click.option("--host", default="127.0.0.1", show_default=True, envvar="AISYNERGY_HOST")
@click.option("--port", default=8000, show_default=True, type=int, envvar="AISYNERGY_PORT")
@_db
@click.option("--broker-url", envvar="AISYNERGY_BROKER_URL", default="mqtts://127.0.0.1:8883", show_default=True)
@click.option("--public-mqtt-url", envvar="AISYNERGY_PUBLIC_MQTT_URL", default=None, help="what agents are told (default: --broker-url)")
@click.option("--heartbeat-interval", type=float, envvar="AISYNERGY_HEARTBEAT_INTERVAL_S", default=None, help="seconds between agent heartbeats (default 10)")
@click.option("--offline-after-missed", type=int, envvar="AISYNERGY_OFFLINE_AFTER_MISSED", default=None, help="missed heartbeats before OFFLINE (default 3)")
@click.option("--tls/--no-tls", default=True, show_default=True, envvar="AISYNERGY_TLS",
              help="serve HTTPS; --no-tls only behind a proxy that terminates TLS (tokens must never travel in clear)")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path), envvar="AISYNERGY_TLS_CERT",
              help="the server certificate (PEM chain) to serve; default: one the hub CA issues (DATA_DIR/pki/hub-https.crt)")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), envvar="AISYNERGY_TLS_KEY", help="the key of --tls-cert")
@click.option("--tls-name", "tls_names", multiple=True, metavar="NAME", help="a host name or address agents use for the hub, put in the default certificate; repeatable")
@_data_dir
def serve(host: str, port: int, database_url: str | None, broker_url: str, public_mqtt_url: str | None,
          heartbeat_interval: float | None, offline_after_missed: int | None, tls: bool, tls_cert: Path | None,
          tls_key: Path | None, tls_names: tuple[str, ...], data_dir: Path) -> None:  # fmt: skip
    """Run the hub (creates and migrates the database on start)."""
    import uvicorn
    from pydantic import ValidationError

    from cloud.api.app import create_app
    from cloud.config import Settings
    from cloud.pki import CertificateAuthority

    overrides: dict[str, object] = {"data_dir": data_dir, "broker_url": broker_url}
    for key, value in (("database_url", database_url), ("public_mqtt_url", public_mqtt_url),
                       ("heartbeat_interval_s", heartbeat_interval), ("offline_after_missed", offline_after_missed)):  # fmt: skip
        if value is not None:
            overrides[key] = value
    try:
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise click.UsageError(f"invalid settings: {exc}") from exc
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    https: dict[str, object] = {}
    if tls:
        if tls_cert is None:
            hosts = tuple(dict.fromkeys((*tls_names, *([host] if host not in ("0.0.0.0", "::") else []))))
            tls_cert, tls_key = CertificateAuthority.load_or_create(settings.pki_dir).ensure_server_identity("hub-https", "aisynergy-hub", hosts)
        elif tls_names:
            raise click.UsageError("--tls-name names hosts in the default certificate: not with --tls-cert")
        # TLS 1.2 at least, AEAD suites with forward secrecy only (TLS 1.3's are all such)
        https = {"ssl_certfile": str(tls_cert), "ssl_keyfile": str(tls_key), "ssl_ciphers": TLS12_CIPHERS}
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info", timeout_graceful_shutdown=5, **https)  # type: ignore[arg-type]


@hub.command()
@_db
@_data_dir
def migrate(database_url: str | None, data_dir: Path) -> None:
    """Create or upgrade the database schema."""
    from cloud.config import Settings
    from cloud.db import upgrade

    settings = Settings(data_dir=data_dir, database_url=database_url)
    assert settings.database_url
    upgrade(settings.database_url)
    click.echo("database is at the latest schema")


@hub.group()
def token() -> None:
    """Integrator bearer tokens."""


@token.command("create")
@click.option("--role", type=click.Choice([r.value for r in Role]), required=True)
@click.option("--name", default="", help="what the token is for")
@_db
@_data_dir
def token_create(role: str, name: str, database_url: str | None, data_dir: Path) -> None:
    """Create a token and print it (it is shown only once)."""
    from sqlmodel import Session

    from cloud.auth import create_api_token

    engine = _engine(data_dir, database_url)
    with Session(engine) as session:
        _row, secret = create_api_token(session, Role(role), name)
    engine.dispose()
    click.echo(secret)


@token.command("list")
@_db
@_data_dir
def token_list(database_url: str | None, data_dir: Path) -> None:
    """List tokens (id, role, name, created, revoked); secrets are never stored, so never shown."""
    from sqlmodel import Session, select

    from cloud.tables import ApiToken

    engine = _engine(data_dir, database_url)
    with Session(engine) as session:
        for row in session.exec(select(ApiToken).order_by(ApiToken.created_at)):  # type: ignore[arg-type]
            revoked = row.revoked_at.isoformat() if row.revoked_at else "-"
            click.echo(f"{row.id}\t{row.role}\t{row.name or '-'}\t{row.created_at.isoformat()}\trevoked={revoked}")
    engine.dispose()


@token.command("revoke")
@click.argument("token_id")
@_db
@_data_dir
def token_revoke(token_id: str, database_url: str | None, data_dir: Path) -> None:
    """Revoke a token by id; running hubs refuse it within their token cache TTL (AISYNERGY_TOKEN_CACHE_TTL_S)."""
    from sqlmodel import Session

    from cloud.auth import revoke_api_token

    engine = _engine(data_dir, database_url)
    with Session(engine) as session:
        row = revoke_api_token(session, token_id)
    engine.dispose()
    if row is None:
        raise click.ClickException(f"no token {token_id}")
    click.echo(f"revoked {token_id}")


@hub.group()
def rotate() -> None:
    """Replace a hub key while the fleet keeps working (a running hub and broker take the new one)."""


@rotate.command("signing-key")
@_data_dir
def rotate_signing_key(data_dir: Path) -> None:
    """A new artefact-signing key. The old key signs the hand-over; manifests signed from now on carry it, so
    targets that pin the old key trust the new one on their next order. The old public key is kept: artefacts
    signed before stay verifiable, targets enrolled later pin it too, and download tokens it signed stay valid
    until they expire. A running hub signs with the new key from its next signature."""
    from cloud.config import Settings
    from cloud.signing import KeyringError, rotate
    from interfaces.deployments import MAX_KEY_TRANSITIONS

    settings = Settings(data_dir=data_dir)
    try:
        done = rotate(settings.pki_dir)
    except (KeyringError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"signing key {done.old_key_id} -> {done.new_key_id}")
    if done.dropped:
        click.echo(f"forgotten (older than the {MAX_KEY_TRANSITIONS} rotations kept; targets that still pin them re-enrol): {', '.join(done.dropped)}")


@rotate.command("broker-certificate")
@click.option("--hostname", "hostnames", multiple=True, metavar="NAME", help="a name or address agents use for the broker, added to those of the current certificate; repeatable")
@_data_dir
def rotate_broker_certificate(hostnames: tuple[str, ...], data_dir: Path) -> None:
    """A new key and certificate for the broker, from the hub CA, for the names of the current one. Agents
    check the broker by the CA, so none needs telling; a running broker (``aisynergy broker run``, or its
    ``share``) serves it to new connections within a second, open ones stay up."""
    from cloud.config import Settings
    from cloud.pki import CertificateAuthority

    settings = Settings(data_dir=data_dir)
    cert = CertificateAuthority.load_or_create(settings.pki_dir).rotate_server_identity("broker", "aisynergy-broker", hostnames)
    click.echo(f"broker certificate serial {cert.serial_number:x}, valid until {cert.not_valid_after_utc.isoformat()}")


def _engine(data_dir: Path, database_url: str | None) -> Engine:
    from cloud.config import Settings
    from cloud.db import make_engine, upgrade

    settings = Settings(data_dir=data_dir, database_url=database_url)
    assert settings.database_url
    upgrade(settings.database_url)
    return make_engine(settings.database_url)
