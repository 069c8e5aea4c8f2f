"""The engine store: built artefacts on disk, keyed by everything that makes them valid.

One file per key (model content hash, precision, backend and its version, device, profile
shapes, build options), with a manifest beside it that repeats the key and the file's
SHA-256. Writes go to a temporary file that is renamed into place, under an exclusive lock
per key, so two processes never build the same engine twice and a killed build never leaves
a file that loads. A file whose manifest is missing, foreign or does not match its checksum is
rebuilt, never loaded. A file that verifies but that its backend cannot load is discarded by
the backend (``discard``) and rebuilt.

The store also keeps what each model's start spent in it (``phases``): looking artefacts up
(reading and verifying them), building and compiling them, and loading what was found, so the
start-up log can say where a slow start went.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1

# The kinds of artefact whose build is a compile of generated code (the torch backend's
# packages), not a precision variant or an engine plan: their time is the "compile" phase.
COMPILED_KINDS = frozenset({"aoti"})


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def default_root() -> Path:
    """``$XDG_CACHE_HOME/stoker/engines``, else ``~/.cache/stoker/engines``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "stoker" / "engines"


@dataclass(frozen=True)
class EngineKey:
    """Everything an artefact depends on. Two keys that differ in any field never share a
    file; ``options`` holds backend and precision build options (JSON-serialisable)."""

    model: str
    model_hash: str
    precision: str
    backend: str
    backend_version: str
    device: str
    profile: tuple[int, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "engine"

    def as_json(self) -> dict[str, Any]:
        """The key as JSON data, normalised (tuples become lists) so that it compares equal
        to its own copy read back from a manifest."""
        data: dict[str, Any] = json.loads(
            json.dumps(asdict(self) | {"options": dict(self.options)})
        )
        return data

    def digest(self) -> str:
        canonical = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class StoredEngine:
    path: Path
    manifest: dict[str, Any]

    @property
    def extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = self.manifest.get("extra", {})
        return extra


class StartPhases:
    """Seconds spent per model and phase (``store lookup``, ``build``, ``compile``, ``load``),
    summed over every artefact of the model; thread-safe (versions load side by side)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: defaultdict[str, defaultdict[str, float]] = defaultdict(
            lambda: defaultdict(float)
        )

    def add(self, model: str, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[model][phase] += seconds

    def of(self, model: str) -> dict[str, float]:
        """The model's totals so far (a copy: subtract two to time one load)."""
        with self._lock:
            return dict(self._seconds.get(model, {}))


class EngineStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.phases = StartPhases()
        # Builds nested in a build (a variant's calibration) are that build's time, counted
        # once: only the outermost call of a thread adds to ``phases``.
        self._building = threading.local()

    def _outermost(self) -> bool:
        return not getattr(self._building, "depth", 0)

    def path_for(self, key: EngineKey, suffix: str) -> Path:
        safe_model = "".join(c if c.isalnum() or c in "-_." else "_" for c in key.model)
        return (
            self.root
            / safe_model
            / f"{key.kind}-{key.precision}-{key.backend}-{key.digest()}{suffix}"
        )

    @staticmethod
    def _manifest_path(path: Path) -> Path:
        return path.with_name(path.name + ".manifest.json")

    def load(self, key: EngineKey, suffix: str, *, discard: bool = False) -> StoredEngine | None:
        """The stored artefact for ``key`` if it is there and verifies, else None.

        Only a caller holding the key's lock may ``discard`` a file that fails verification:
        without the lock it may be a build that is being renamed into place right now.
        """
        started = time.perf_counter()
        try:
            return self._verified(key, suffix, discard)
        finally:
            if self._outermost():
                self.phases.add(key.model, "store lookup", time.perf_counter() - started)

    def _verified(self, key: EngineKey, suffix: str, discard: bool) -> StoredEngine | None:
        path = self.path_for(key, suffix)
        manifest_path = self._manifest_path(path)
        if not path.exists():
            return None
        problem = None
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as exc:
            manifest, problem = {}, f"manifest unreadable ({type(exc).__name__})"
        if problem is None and manifest.get("key") != key.as_json():
            problem = "manifest belongs to another key"
        if problem is None and manifest.get("sha256") != sha256_file(path):
            problem = "checksum mismatch"
        if problem is not None:
            if not discard:
                return None
            self._remove(path, problem)
            return None
        return StoredEngine(path, manifest)

    def _remove(self, path: Path, why: str) -> None:
        log.warning("engine store: discarding %s: %s; it will be rebuilt", path, why)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with contextlib.suppress(FileNotFoundError):
            self._manifest_path(path).unlink()

    def discard(self, key: EngineKey, suffix: str, why: str) -> None:
        """Remove ``key``'s artefact that verified but does not load (``why``), under its
        lock, so that the next ``get_or_build`` builds it again."""
        path = self.path_for(key, suffix)
        with self._locked(path):
            self._remove(path, why)

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = path.with_name(path.name + ".lock")
        with lock_path.open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("engine store: another process is building %s; waiting", path.name)
                started = time.monotonic()
                fcntl.flock(lock, fcntl.LOCK_EX)
                log.info(
                    "engine store: waited %.1f s for %s", time.monotonic() - started, path.name
                )
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def get_or_build(
        self,
        key: EngineKey,
        build: Callable[[Path], Mapping[str, Any] | None],
        suffix: str,
    ) -> StoredEngine:
        """The artefact for ``key``, built by ``build(temporary_path)`` if it is missing.

        ``build`` writes the file and may return extra facts for the manifest (an accuracy
        report, build time). It runs at most once per key across processes sharing the store.
        """
        path = self.path_for(key, suffix)
        found = self.load(key, suffix)
        if found is not None:
            return found
        with self._locked(path):
            # Another process may have built it while we waited for the lock.
            found = self.load(key, suffix, discard=True)
            if found is not None:
                return found
            for stale in path.parent.glob(f".{path.name}.*.tmp"):
                stale.unlink()  # left by a killed build; we hold the lock, so nobody owns it
            temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            started = time.perf_counter()
            phase = "compile" if key.kind in COMPILED_KINDS else "build"
            outermost = self._outermost()
            self._building.depth = getattr(self._building, "depth", 0) + 1
            try:
                extra = build(temporary)
                with temporary.open("rb") as f:
                    os.fsync(f.fileno())
                manifest = {
                    "manifest_version": MANIFEST_VERSION,
                    "key": key.as_json(),
                    "sha256": sha256_file(temporary),
                    "size": temporary.stat().st_size,
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build_seconds": round(time.perf_counter() - started, 3),
                    "extra": dict(extra or {}),
                }
                os.replace(temporary, path)
            finally:
                self._building.depth -= 1
                if outermost:
                    self.phases.add(key.model, phase, time.perf_counter() - started)
                with contextlib.suppress(FileNotFoundError):
                    temporary.unlink()
            manifest_tmp = path.with_name(f".{path.name}.manifest.{os.getpid()}.tmp")
            manifest_tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
            os.replace(manifest_tmp, self._manifest_path(path))
            return StoredEngine(path, manifest)
