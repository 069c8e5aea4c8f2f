"""The registry: every configured model, its loaded versions, and the versions refused.

It loads them all through ``app.engine.models`` at startup, records a version that misses its
accuracy budget or fails to load (with the reason its 503s give), answers which version
serves a request, says what is ready, and closes everything in reverse order of loading.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from app.engine.models import LoadedModel, load, source
from app.engine.repository import ModelEntry, discover
from app.errors import NotFound, Unavailable, client_text
from app.metrics import model_unavailable
from app.settings import Settings
from engines import backends
from engines.base import FatalEngineError
from engines.precision.build import AccuracyBudgetExceeded, BuildCancelled
from engines.store import EngineStore

log = logging.getLogger(__name__)


class Registry:
    """Every configured model, its loaded versions, and the versions refused with why.

    Readiness, per level: a version is ready while its batcher runs (``LoadedModel.ready``);
    the registry is ready once loading is over, something serves and every loaded version is
    ready (``ready``); a refused version does not hold it back, it answers 503 with its
    reason.
    """

    def __init__(self, settings: Settings, one_device: bool = False) -> None:
        """``one_device``: this process serves on the one GPU it sees (an engine process of
        ``server.engine_gpus``): every model's ``gpus`` is dropped, so its runners go to it."""
        self.settings = settings
        self.one_device = one_device
        self.store = EngineStore(settings.store.path)
        self._entries: list[ModelEntry] = []
        self._loaded: dict[str, dict[str, LoadedModel]] = {}
        # model -> version -> why it is not served (it missed its budget or failed to load).
        self._unavailable: dict[str, dict[str, str]] = {}
        self.loading_done = False
        # Set when the server stops: a build running in a worker thread stops at its next
        # check instead of holding the process up until it ends.
        self.stopping = threading.Event()

    # -- loading and closing

    async def load_all(self) -> None:
        """Load every model, warm every runner. A version that misses its accuracy budget
        or fails to load is not served and says why (unless ``models.exit_on_error``); the
        others serve. Nothing at all to serve is an error."""
        repo = self.settings.models
        self._entries = discover(repo.repository, repo.models)
        if self.one_device:
            self._entries = [
                entry.model_copy(update={"config": entry.config.model_copy(update={"gpus": []})})
                for entry in self._entries
            ]
        for entry in self._entries:
            try:
                await self._load(entry)
            except BuildCancelled as stopped:
                log.info("loading stopped, the server is shutting down: %s", stopped)
                return
            except FatalEngineError:
                raise  # the device is broken for every model: liveness must go
            except Exception as error:
                # What every version needs (the ONNX file, its spec) is missing; _load
                # registers a model's versions only once all of them were tried.
                for precision in entry.config.precisions:
                    self._refuse(entry.config.name, precision, error)
        refused = [f"{n}[{v}]" for n, versions in self._unavailable.items() for v in versions]
        if not self.loaded():
            # Nothing to serve: stop (the orchestrator shows a crash loop) rather than stay
            # live and never ready.
            raise RuntimeError(f"no model version could be served: {', '.join(refused)}")
        self.loading_done = True
        log.info(
            "ready: %s%s",
            ", ".join(f"{n}{sorted(v)}" for n, v in self._loaded.items()) or "no model",
            f"; NOT served: {', '.join(refused)} (see above)" if refused else "",
        )

    def _refuse(self, model: str, version: str, error: Exception) -> None:
        """Record a version that will not be served, once, with the reason its 503s give;
        or re-raise where ``models.exit_on_error`` wants the server to stop."""
        if self.settings.models.exit_on_error:
            raise error
        accuracy_refusal = isinstance(error, AccuracyBudgetExceeded)
        reason = str(error) if accuracy_refusal else f"{type(error).__name__}: {error}"
        # Clients get a bounded reason (a backend's message can be long); the log, all of it.
        self._unavailable.setdefault(model, {})[version] = client_text(reason, 600)
        model_unavailable(model, version, "accuracy" if accuracy_refusal else "load")
        log.error(
            "model %s version %s is NOT served (%s): %s",
            model,
            version,
            "accuracy budget" if accuracy_refusal else "load failed",
            reason,
            # A missing file says it all; anything else may need its traceback.
            exc_info=None if isinstance(error, AccuracyBudgetExceeded | OSError) else error,
        )

    async def _load(self, entry: ModelEntry) -> None:
        config = entry.config
        settings = self.settings.models
        backend = backends.resolve(settings.backend or config.backend)
        model = await asyncio.to_thread(source, entry, settings.prepare_missing)
        versions: dict[str, LoadedModel] = {}
        try:
            for precision in config.precisions:
                try:
                    versions[precision] = await load(
                        model, precision, backend, self.store, self.settings, self.stopping.is_set
                    )
                except (FatalEngineError, BuildCancelled):
                    raise
                except Exception as error:
                    self._refuse(config.name, precision, error)
        except BaseException:
            # Cancelled (shutdown mid-load), fatal, or exit_on_error: what loaded is closed.
            for loaded in versions.values():
                await loaded.close()
            raise
        self._loaded[config.name] = versions

    async def close_batchers(self, timeout_s: float) -> None:
        """Fail what is still queued after ``timeout_s`` (a running batch finishes)."""
        await asyncio.gather(*(m.batcher.close(timeout_s) for m in self.loaded()))

    async def close(self) -> None:
        """Free every version in reverse order of loading."""
        self.stopping.set()
        for model in reversed(self.loaded()):
            await model.close()
        self._loaded.clear()

    # -- state

    @property
    def ready(self) -> bool:
        served = self.loaded()
        return self.loading_done and bool(served) and all(m.ready for m in served)

    @property
    def healthy(self) -> bool:
        """False once a version stopped on an unrecoverable engine fault."""
        return all(m.ready for m in self.loaded())

    def loaded(self) -> list[LoadedModel]:
        return [m for versions in self._loaded.values() for m in versions.values()]

    def entries(self) -> list[ModelEntry]:
        return list(self._entries)

    def entry(self, name: str) -> ModelEntry | None:
        return next((e for e in self._entries if e.config.name == name), None)

    def get(self, name: str, version: str | None = None) -> LoadedModel:
        """The loaded version; 404 for an unknown model or version, 503 with the reason for
        one that is refused or still loading."""
        entry = self.entry(name)
        if entry is None:
            raise NotFound(f"unknown model '{client_text(name)}'")
        version = version or entry.config.default_precision
        model = self._loaded.get(name, {}).get(version)
        if model is not None:
            return model
        reason = self._unavailable.get(name, {}).get(version)
        if reason is not None:
            raise Unavailable(f"model {name!r} version {version!r} is not served: {reason}")
        if not self.loading_done and version in entry.config.precisions:
            raise Unavailable(f"model {name!r} is loading")
        raise NotFound(
            f"model {name!r} has no version '{client_text(version)}'; versions: "
            f"{', '.join(entry.config.precisions)}"
        )

    def versions(self, name: str) -> list[str]:
        """The versions of a model that serve."""
        return list(self._loaded.get(name, {}))

    def unavailable(self, name: str) -> dict[str, str]:
        """The versions of a model that are configured but not served, with the reason."""
        return dict(self._unavailable.get(name, {}))

    def index(self) -> list[dict[str, str]]:
        """Triton's repository index: every configured version with its state (READY,
        LOADING, UNAVAILABLE) and, where it is not served, the reason."""
        index = []
        for entry in self._entries:
            name = entry.config.name
            for version in entry.config.precisions:
                item = {"name": name, "version": version}
                reason = self._unavailable.get(name, {}).get(version)
                if reason is not None:
                    item |= {"state": "UNAVAILABLE", "reason": reason}
                elif version in self._loaded.get(name, {}):
                    item["state"] = "READY"
                else:
                    item["state"] = "LOADING"
                index.append(item)
        return index

    def default(self, name: str | None) -> LoadedModel:
        """The model of the plain ``POST /infer``: ``name``, else the first model that
        serves; else the first, whose 503 then says why not."""
        if name is None:
            if not self._entries:
                raise Unavailable("no model is loaded yet")
            served = [e.config.name for e in self._entries if self._loaded.get(e.config.name)]
            name = served[0] if served else self._entries[0].config.name
        return self.get(name)
