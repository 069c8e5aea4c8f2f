"""What the registry knows of each model (``Known``: its config, versions, refusals and
state), and what its states answer: Triton's repository index (every version with its
state, READY, LOADING, UNLOADING or UNAVAILABLE, and why) and a request's 404 or 503 with
the reason; and Triton's model configuration of a loaded version (``triton_config``).
``app.engine.registry`` changes the states; this reports them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from app.engine.folders import ConfigError, Files, check_folder, triton_layout, version_folders
from app.engine.models import LoadedModel
from app.engine.repository import ModelEntry, load_config
from app.errors import NotFound, Unavailable, client_text
from app.settings import ModelRepositorySettings
from engines.spec import TensorSpec

# A model's state, as the repository index names it.
READY = "READY"
LOADING = "LOADING"
UNLOADING = "UNLOADING"
UNAVAILABLE = "UNAVAILABLE"


@dataclass(eq=False)
class Known:
    """One model the registry knows: the config its versions serve with, the versions and
    those refused, and, while it is not serving, what it is doing or why not."""

    entry: ModelEntry | None = None
    """The config in effect (None: nothing ever loaded)."""
    versions: dict[str, LoadedModel] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    """Version -> why it is not served (it missed its budget or failed to load)."""
    state: str = READY
    """READY (its versions serve, or say why not), LOADING (a first load), UNLOADING, or
    UNAVAILABLE (unloaded, or its first load failed: ``reason``)."""
    reason: str = ""
    loading: ModelEntry | None = None
    """The config a load is building (a first load's versions are listed from it)."""
    reloading: bool = False
    last_failure: str = ""
    """Why the last load failed while the versions before it serve on."""
    files: Files | None = None
    """The folder's files when it was last loaded (poll mode compares)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One load or unload of a model at a time; other models change meanwhile."""


def index_items(name: str, known: Known) -> list[dict[str, str]]:
    """The index entries of one known model: each version with its state and reason."""
    entry = known.loading if known.state == LOADING else known.entry
    precisions = entry.config.precisions if entry is not None else [""]
    items = []
    for version in precisions:
        item = {"name": name, "version": version}
        if known.state == READY:
            reason = known.refused.get(version)
            if reason is not None:
                item |= {"state": UNAVAILABLE, "reason": reason}
            else:
                item["state"] = READY
                if known.reloading:
                    item["reason"] = "reloading: this version serves until the new is warm"
                elif known.last_failure:
                    item["reason"] = f"the last load failed: {known.last_failure}"
        elif known.state == UNLOADING:
            if version not in known.versions:
                continue
            item["state"] = UNLOADING
        elif known.state == LOADING:
            item["state"] = LOADING
        else:
            item |= {"state": UNAVAILABLE, "reason": known.reason}
        items.append(item)
    return items


def not_loaded(rules: ModelRepositorySettings, known: Container[str]) -> list[dict[str, str]]:
    """The index entries of the repository's models not in ``known``: UNAVAILABLE, not
    loaded (with why, where the config does not parse, or where a folder without a
    config.yaml is laid out as Triton's). Blocking: it reads every such folder."""
    items = []
    for folder in sorted(rules.repository.iterdir() if rules.repository.is_dir() else ()):
        name = folder.name
        if name in known or name.startswith(".") or not folder.is_dir():
            continue
        if not (folder / "config.yaml").is_file():
            found = version_folders(folder)
            if found:
                reason = f"not loaded: {triton_layout(name, found)}"
                items.append({"name": name, "version": "", "state": UNAVAILABLE, "reason": reason})
            continue
        try:
            check_folder(rules.repository, folder)
            versions = load_config(folder, rules).config.precisions
            reason = "not loaded"
        except ConfigError as error:
            versions, reason = [""], f"not loaded: {error}"
        for version in versions:
            items.append({"name": name, "version": version, "state": UNAVAILABLE, "reason": reason})
    return items


def served_version(name: str, known: Known, version: str | None) -> LoadedModel:
    """The loaded ``version`` of a known model (None: its default); 404 for a version it
    does not have, 503 with the reason for one that is refused, loading, unloading or
    unloaded."""
    if known.state == LOADING:
        raise Unavailable(f"model {name!r} is loading")
    if known.state == UNLOADING:
        raise Unavailable(f"model {name!r} is being unloaded")
    if known.state == UNAVAILABLE or known.entry is None:
        why = f" ({known.reason})" if known.reason not in ("", "not loaded") else ""
        raise Unavailable(f"model {name!r} is not loaded{why}")
    config = known.entry.config
    version = version or config.default_precision
    model = known.versions.get(version)
    if model is not None:
        return model
    reason = known.refused.get(version)
    if reason is not None:
        raise Unavailable(f"model {name!r} version {version!r} is not served: {reason}")
    raise NotFound(
        f"model {name!r} has no version '{client_text(version)}'; versions: "
        f"{', '.join(config.precisions)}"
    )


def triton_config(model: LoadedModel, versions: list[str]) -> dict[str, Any]:
    """Triton's model configuration of ``model``, as its clients read it; ``versions``: the
    versions that serve."""
    config = model.entry.config
    batching = config.dynamic_batching
    spec = model.spec

    def tensor(t: TensorSpec) -> dict[str, Any]:
        return {"name": t.name, "data_type": f"TYPE_{t.datatype}", "dims": list(t.shape)}

    return {
        "name": spec.name,
        "platform": f"{model.backend}_onnx",
        "backend": model.backend,
        "max_batch_size": spec.max_batch_size,
        "input": [tensor(t) for t in spec.inputs],
        "output": [tensor(t) for t in spec.outputs],
        "dynamic_batching": {
            "preferred_batch_size": batching.preferred_batch_size,
            "max_queue_delay_microseconds": batching.max_queue_delay_us,
            "priority_levels": batching.priority_levels,
            "default_queue_policy": {
                "max_queue_size": batching.max_queue_size,
                "default_timeout_microseconds": batching.default_timeout_us,
            },
        },
        "instance_group": [{"count": model.pool.size, "kind": model.backend}],
        "version_policy": {"specific": {"versions": versions}},
        "default_version": config.default_precision,
        "labels": config.labels,
    }
