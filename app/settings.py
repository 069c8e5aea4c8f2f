"""One settings object, nested by concern, every field settable by environment.

``STOKER_SERVER__PORT=9000`` sets ``settings.server.port``; the flat aliases listed in the
README (``STOKER_PORT``...) are not provided on purpose: one spelling per field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from engines.store import default_root


class ServerSettings(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    host: str = "127.0.0.1"
    """Address to bind. 127.0.0.1 keeps a laptop server private; containers set 0.0.0.0."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port; 0 picks a free one (tests)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log verbosity. ``debug`` logs every batch, which costs throughput."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On shutdown, how long in-flight and queued requests may take to finish before exit.
    Keep it below Kubernetes' terminationGracePeriodSeconds."""


class ModelRepositorySettings(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    repository: Path = Path("models")
    """Folder with one sub-folder per model, each holding a config.yaml."""
    models: list[str] = Field(default_factory=list)
    """Models to load (folder names); empty loads every model that has a config. Loading
    fewer models starts faster and uses less memory."""
    default_model: str | None = None
    """Model answering the plain ``POST /infer``; defaults to the first loaded model."""
    backend: str | None = None
    """Override every model's backend (``auto``, ``onnxruntime``...). ``auto`` picks the
    fastest backend this machine can run."""
    prepare_missing: bool = True
    """Generate a missing ONNX file from the model's ``generator`` at startup (offline,
    seconds for the bundled models). Off makes a missing file a startup error."""


class StoreSettings(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    path: Path = Field(default_factory=default_root)
    """Where built variants, engines and calibration ranges are kept. Put it on a volume in
    containers so a restarted pod loads in seconds instead of rebuilding."""


class LimitSettings(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    """Largest request body; bigger ones get 413 before they are read whole. Raise it for
    large binary batches, at the cost of memory per concurrent request."""
    max_image_pixels: int = Field(default=40_000_000, gt=0)
    """Largest decoded image (width x height); protects against decompression bombs."""
    max_images_per_request: int = Field(default=64, gt=0)
    """Most images in one ``/infer`` upload; each costs a decode on the CPU."""
    default_top_k: int = Field(default=5, gt=0)
    """Labels returned by ``/infer`` when the request does not say ``k``."""


class Settings(BaseSettings):
    """Stoker's configuration: built once at startup, logged, passed down."""

    model_config = SettingsConfigDict(
        env_prefix="STOKER_",
        env_nested_delimiter="__",
        use_attribute_docstrings=True,
        extra="forbid",
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    """HTTP server."""
    models: ModelRepositorySettings = Field(default_factory=ModelRepositorySettings)
    """Which models are served and how they are found."""
    limits: LimitSettings = Field(default_factory=LimitSettings)
    """What one request may ask for."""
    store: StoreSettings = Field(default_factory=StoreSettings)
    """The engine store."""

    def loggable(self) -> dict[str, Any]:
        """Settings for the startup log; nothing here is secret yet, fields named like a
        secret are redacted anyway so a future key never reaches a log."""
        data: dict[str, Any] = self.model_dump(mode="json")

        def redact(node: Any) -> Any:
            if isinstance(node, dict):
                return {
                    k: "***"
                    if any(s in k for s in ("key", "token", "secret", "password"))
                    else redact(v)
                    for k, v in node.items()
                }
            return node

        result: dict[str, Any] = redact(data)
        return result
