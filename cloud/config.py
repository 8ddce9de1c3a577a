"""Hub settings: one pydantic-settings model, read from ``AISYNERGY_*`` environment variables and CLI flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Documented bounds (README "Liveness"): the offline timeout is heartbeat_interval_s * offline_after_missed.
from interfaces.nodes import MAX_HEARTBEAT_INTERVAL_S, MAX_OFFLINE_AFTER_MISSED, MIN_HEARTBEAT_INTERVAL_S


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AISYNERGY_", extra="ignore")

    data_dir: Path = Field(default=Path(".data"), description="PKI, default SQLite database, broker files")
    database_url: str | None = Field(default=None, description="default: sqlite:///<data_dir>/hub.db")
    broker_url: str = Field(default="mqtts://127.0.0.1:8883", description="where the hub connects")
    public_mqtt_url: str | None = Field(default=None, description="what agents are told; default broker_url")
    mqtt_client_id: str = Field(default="hub", description="must equal the hub certificate's CN")
    heartbeat_interval_s: float = Field(default=10.0, ge=MIN_HEARTBEAT_INTERVAL_S, le=MAX_HEARTBEAT_INTERVAL_S)
    offline_after_missed: int = Field(default=3, ge=1, le=MAX_OFFLINE_AFTER_MISSED)
    heartbeat_flush_interval_s: float = Field(default=0.2, gt=0, le=5)
    liveness_check_interval_s: float = Field(default=1.0, gt=0, le=60)
    rollout_interval_s: float = Field(default=0.5, gt=0, le=3600, description="how often the rollout controller drives deployments")
    scheduler_interval_s: float = Field(default=1.0, gt=0, le=3600, description="how often the task scheduler looks at every active task (API calls and worker reports wake it sooner)")
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    max_artifact_bytes: int = Field(default=2 * 1024**3, ge=1, description="largest artefact POST /artifacts accepts (streamed to disk)")
    upload_chunk_bytes: int = Field(default=8 * 1024**2, ge=64 * 1024, le=256 * 1024**2, description="chunk size of a chunked upload (/artifacts/uploads)")
    upload_ttl_s: int = Field(default=24 * 3600, ge=60, le=30 * 24 * 3600, description="how long a chunked upload session and its chunks are kept")
    idempotency_ttl_s: int = Field(default=24 * 3600, ge=60)
    token_cache_ttl_s: float = Field(default=10.0, ge=0, le=300)
    sse_streams_per_token: int = Field(default=4, ge=1, le=1000, description="concurrent task log streams one bearer token may hold (429 beyond)")
    sse_token_check_s: float = Field(default=5.0, gt=0, le=300, description="how often a log stream checks its token again (a revoked one ends it)")
    sse_poll_s: float = Field(default=2.0, gt=0, le=60, description="how often a log stream reads the database when nothing in this process woke it (other replicas' writes)")
    certificate_validity_days: int = Field(default=365, ge=1, le=3650)
    enable_mqtt: bool = Field(default=True, description="off only for tests of the REST layer alone")

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        if self.database_url is None:
            self.database_url = f"sqlite:///{(self.data_dir / 'hub.db').resolve()}"
        if self.public_mqtt_url is None:
            self.public_mqtt_url = self.broker_url
        return self

    @property
    def pki_dir(self) -> Path:
        return self.data_dir / "pki"

    @property
    def offline_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.offline_after_missed
