"""A client of a running server's model control endpoints (``stoker models --load``): the
calls an operator makes with curl, over the standard library's HTTP (the CLI needs no client
dependency)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml


class ControlError(Exception):
    """The server refused, or could not be reached: what it said, or why not."""


def read_config(path: Path) -> dict[str, Any]:
    """A config file (YAML, or JSON, which YAML reads) as a load's override."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ControlError(f"cannot read {path}: {error}") from None
    if not isinstance(document, dict):
        raise ControlError(f"{path}: expected a mapping at the top level")
    return document


class Client:
    def __init__(self, url: str, key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.timeout_s = timeout_s

    def load(self, name: str, config: dict[str, Any] | None = None) -> None:
        # Triton's form: the config as JSON text in parameters.config.
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
        self._post(f"/v2/repository/models/{urllib.parse.quote(name, safe='')}/load", body)

    def unload(self, name: str) -> None:
        self._post(f"/v2/repository/models/{urllib.parse.quote(name, safe='')}/unload", {})

    def index(self) -> list[dict[str, str]]:
        found: list[dict[str, str]] = self._post("/v2/repository/index", {})
        return found

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            try:
                said = json.loads(error.read()).get("error", "")
            except (ValueError, AttributeError):
                said = ""
            raise ControlError(f"{path}: HTTP {error.code}: {said or error.reason}") from None
        except (urllib.error.URLError, OSError) as error:
            raise ControlError(f"cannot reach {self.url}: {error}") from None
