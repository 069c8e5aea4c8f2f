"""The registry: every model it knows, the versions that serve, those refused and why, and how
the set changes while serving (``models.control``).

At startup it loads the models the mode names (``load_all``) through ``app.engine.models``.
In explicit and poll mode, ``load`` loads a model or reloads it: the new versions are built
and warmed beside the old ones, which serve meanwhile, and one assignment switches to them;
the old ones finish what they queued and are freed. ``unload`` refuses new requests to the
model at once, lets what it queued finish (within the drain timeout), frees its runners and
engines and removes its metrics. A load that fails leaves what served serving and says why
(the answer to the load, the index, the 503s of a model that never loaded).

Kept in one module (~520 lines): loading, reloading, unloading and the refusals are one state
machine over each model's ``Known`` record (versions, refused, state, loading) under its
lock; split, a transition would live away from the state it guards. The model folders' rules are in
``app.engine.folders``, the index in ``app.engine.index``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, NoReturn

from app.engine.folders import (
    ConfigError,
    Files,
    check_folder,
    fingerprint,
    model_folder,
    triton_layout,
    valid_name,
    version_folders,
    without_paths,
)
from app.engine.index import (
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    Known,
    index_items,
    not_loaded,
    served_version,
)
from app.engine.models import LoadedModel, load, release_memory, source
from app.engine.repository import ModelEntry, discover, load_config, parse_config
from app.engine.startup import describe_phases
from app.errors import BadRequest, NotFound, Unavailable, client_text
from app.metrics import model_available, model_unavailable
from app.settings import Settings
from engines import backends
from engines.base import FatalEngineError
from engines.heap import freeze_heap
from engines.precision.build import AccuracyBudgetExceeded, BuildCancelled
from engines.store import EngineStore

log = logging.getLogger(__name__)


class Registry:
    """Every known model, its loaded versions, and the versions refused with why.

    Readiness, per level: a version is ready while its batcher runs (``LoadedModel.ready``);
    the registry is ready once loading at startup is over, something serves (or the mode
    lets models come later) and every loaded version is ready (``ready``); a refused version
    does not hold it back, it answers 503 with its reason.
    """

    def __init__(self, settings: Settings, one_device: bool = False) -> None:
        """``one_device``: this process serves on the one GPU it sees (an engine process of
        ``server.engine_gpus``): every model's ``gpus`` is dropped, so its runners go to it."""
        self.settings = settings
        self.one_device = one_device
        self.store = EngineStore(settings.store.path)
        self._known: dict[str, Known] = {}
        self.loading_done = False
        self.generation = 0
        """Counts changes of the served set: front ends drop what they cached from it when
        it moves (``app.frontend.remote``)."""
        # Set when the server stops: a build running in a worker thread stops at its next
        # check instead of holding the process up until it ends.
        self.stopping = threading.Event()

    @property
    def controlled(self) -> bool:
        """Whether models load and unload while serving (explicit or poll mode)."""
        return self.settings.models.control != "none"

    # -- loading at startup and closing

    def startup_entries(self) -> list[ModelEntry]:
        """What loads at start: the named models or every autoloading one; in explicit
        mode, ``models.startup`` where it is set."""
        repo = self.settings.models
        if repo.control == "explicit" and repo.startup is not None:
            if not repo.repository.is_dir():
                raise ConfigError(f"model repository {repo.repository} does not exist")
            return [self._config_of(name) for name in repo.startup]
        return discover(repo.repository, repo.models, repo)

    async def load_all(self) -> None:
        """Load every model of ``startup_entries``, warm every runner. A version that misses
        its accuracy budget or fails to load is not served and says why (unless
        ``models.exit_on_error``); the others serve. Nothing at all to serve is an error in
        mode none, where nothing can be loaded later."""
        started = time.perf_counter()
        entries = [self._placed(e) for e in await asyncio.to_thread(self.startup_entries)]
        for entry in entries:
            self._known[entry.config.name] = Known(state=LOADING, loading=entry)
        for entry in entries:
            known = self._known[entry.config.name]
            known.files = await asyncio.to_thread(fingerprint, entry.folder)
            generated = not entry.onnx_path.exists()
            try:
                versions, refused = await self._load(entry, {}, startup=True)
            except BuildCancelled as stopped:
                log.info("loading stopped, the server is shutting down: %s", stopped)
                return
            self._settle(known, entry, versions, refused)
            if generated:  # its generator wrote the folder: that is no change to reload for
                known.files = await asyncio.to_thread(fingerprint, entry.folder)
        refused_all = [f"{name}[{v}]" for name, known in self._known.items() for v in known.refused]
        if not self.loaded() and not self.controlled:
            # Nothing to serve: stop (the orchestrator shows a crash loop) rather than stay
            # live and never ready.
            raise RuntimeError(f"no model version could be served: {', '.join(refused_all)}")
        await asyncio.to_thread(freeze_heap)
        self.loading_done = True
        served = {n: sorted(k.versions) for n, k in self._known.items() if k.versions}
        # The last start-up line says where the start went, per version and phase.
        phases = [
            f"{name} {version}: {describe_phases(loaded.phases)}"
            for name, known in self._known.items()
            for version, loaded in sorted(known.versions.items())
        ]
        log.info(
            "ready: %s%s in %.1f s (%s)",
            ", ".join(f"{n}{v}" for n, v in served.items()) or "no model",
            f"; NOT served: {', '.join(refused_all)} (see above)" if refused_all else "",
            time.perf_counter() - started,
            "; ".join(phases) or "nothing loaded",
        )

    def _refuse(self, entry: ModelEntry, version: str, error: Exception, startup: bool) -> str:
        """Record a version that will not be served, once; the reason its 503s give (the
        log names the model's folder, the reason does not). At startup, re-raise where
        ``models.exit_on_error`` wants the server to stop."""
        model = entry.config.name
        if startup and self.settings.models.exit_on_error:
            raise error
        accuracy_refusal = isinstance(error, AccuracyBudgetExceeded)
        reason = str(error) if accuracy_refusal else f"{type(error).__name__}: {error}"
        public = without_paths(
            reason, {self.settings.models.repository: "", self.settings.store.path: "<store>/"}
        )
        model_unavailable(model, version, "accuracy" if accuracy_refusal else "load")
        log.error(
            "model %s version %s is NOT served (%s, from %s): %s",
            model,
            version,
            "accuracy budget" if accuracy_refusal else "load failed",
            entry.folder,
            reason,
            # A missing file says it all; anything else may need its traceback.
            exc_info=None if isinstance(error, AccuracyBudgetExceeded | OSError) else error,
        )
        # Clients get a bounded reason (a backend's message can be long) without the server's
        # paths; the log, all of it.
        return client_text(public, 600)

    async def _load(
        self, entry: ModelEntry, previous: dict[str, LoadedModel], startup: bool = False
    ) -> tuple[dict[str, LoadedModel], dict[str, str]]:
        """Every version of ``entry`` loaded and warmed, or refused with why; ``previous``:
        the versions they replace, whose metrics they continue."""
        config = entry.config
        settings = self.settings.models
        refused: dict[str, str] = {}
        try:
            backend = backends.resolve(settings.backend or config.backend)
            model = await asyncio.to_thread(source, entry, settings.prepare_missing)
        except (FatalEngineError, BuildCancelled):
            raise
        except Exception as error:
            # What every version needs (the ONNX file, its spec) is missing.
            for precision in config.precisions:
                refused[precision] = self._refuse(entry, precision, error, startup)
            return {}, refused
        versions: dict[str, LoadedModel] = {}
        try:
            for precision in config.precisions:
                old = previous.get(precision)
                metrics = old.metrics if old is not None else None
                try:
                    versions[precision] = await load(
                        model,
                        precision,
                        backend,
                        self.store,
                        self.settings,
                        self.stopping.is_set,
                        metrics,
                    )
                except (FatalEngineError, BuildCancelled):
                    raise
                except Exception as error:
                    refused[precision] = self._refuse(entry, precision, error, startup)
        except BaseException:
            # Cancelled (shutdown mid-load), fatal, or exit_on_error: what loaded is closed.
            for loaded in versions.values():
                await loaded.close()
            raise
        return versions, refused

    def _settle(
        self,
        known: Known,
        entry: ModelEntry,
        versions: dict[str, LoadedModel],
        refused: dict[str, str],
    ) -> dict[str, LoadedModel]:
        """Switch ``known`` to the versions of ``entry`` in one step; the versions it served
        before are returned, each pointing at the one that replaces it."""
        old = known.versions
        for version in versions:
            model_available(entry.config.name, version)
        for version, before in old.items():
            before.replaced_by = versions.get(version)
        known.entry, known.versions, known.refused = entry, versions, refused
        known.state, known.reason, known.loading, known.last_failure = READY, "", None, ""
        self.generation += 1
        return old

    async def close_batchers(self, timeout_s: float) -> None:
        """Fail what is still queued after ``timeout_s`` (a running batch finishes)."""
        await asyncio.gather(*(m.batcher.close(timeout_s) for m in self.loaded()))

    async def close(self) -> None:
        """Free every version in reverse order of loading."""
        self.stopping.set()
        for model in reversed(self.loaded()):
            await model.close()
        for known in self._known.values():
            known.versions = {}

    # -- model control

    def _config_of(self, name: str, override: object = None) -> ModelEntry:
        """The config a load of ``name`` serves with: its config.yaml, or ``override`` (a
        load request's, for the same folder), within the repository's rules. Blocking: it
        reads the folder."""
        rules = self.settings.models
        folder = model_folder(rules.repository, name)
        if folder is None:
            self._not_a_model(name)
        check_folder(rules.repository, folder)
        if override is None:
            return load_config(folder, rules)
        entry = parse_config(folder, override, f"the config given for model {name!r}", rules)
        if entry.config.name != name:
            raise ConfigError(
                f"the config given for model {name!r}: name "
                f"'{client_text(entry.config.name)}' is not the model's"
            )
        if entry.config.generator is not None:
            # A generator writes files into the operator's folder: only config.yaml names one.
            try:
                own = load_config(folder, rules).config.generator
            except ConfigError:
                own = None
            if entry.config.generator != own:
                raise ConfigError(
                    f"the config given for model {name!r}: generator "
                    f"'{client_text(entry.config.generator)}' is not the one its config.yaml "
                    "names (a load's config cannot choose what writes the model's files)"
                )
        return entry

    def _not_a_model(self, name: str) -> NoReturn:
        """404 for a name the repository has no model folder of; 400 saying why for a folder
        laid out as Triton's, with numbered version folders and no config.yaml."""
        repository = self.settings.models.repository
        if valid_name(name):
            found = version_folders(repository / name)
            if found:
                raise BadRequest(triton_layout(name, found))
        raise NotFound(f"no model '{client_text(name)}' in the repository (no <model>/config.yaml)")

    def _placed(self, entry: ModelEntry) -> ModelEntry:
        if not self.one_device:
            return entry
        return entry.model_copy(update={"config": entry.config.model_copy(update={"gpus": []})})

    async def load(self, name: str, override: dict[str, Any] | None = None) -> None:
        """Load model ``name`` from its folder (``override``: a config in place of its
        config.yaml), or reload it. A reload builds and warms the new versions while the
        old ones serve, then switches; the old ones finish what they queued and are freed.
        If the default version does not load, nothing changes (what served serves on) and
        ``BadRequest`` says why; other versions that do not load say why in the index."""
        if model_folder(self.settings.models.repository, name) is None:
            self._not_a_model(name)
        known = self._known.setdefault(name, Known(state=UNAVAILABLE, reason="not loaded"))
        async with known.lock:
            if self.stopping.is_set():
                raise Unavailable("server is shutting down; models are not loaded")
            files = await asyncio.to_thread(fingerprint, self.settings.models.repository / name)
            first = not known.versions
            try:
                entry = self._placed(await asyncio.to_thread(self._config_of, name, override))
            except ConfigError as error:
                self._failed(name, known, first, files, f"ConfigError: {error}")
                raise BadRequest(f"model {name!r} did not load: {error}") from None
            generated = not entry.onnx_path.exists()
            if first:
                known.state, known.loading = LOADING, entry
            else:
                known.reloading = True
            self.generation += 1
            log.info("model %s: %s", name, "loading" if first else "reloading beside the old")
            try:
                versions, refused = await self._load(entry, known.versions)
            except BuildCancelled:
                self._failed(name, known, first, files, "the server is shutting down")
                raise Unavailable("server is shutting down; models are not loaded") from None
            except BaseException:
                self._failed(name, known, first, files, "the load was interrupted")
                raise
            finally:
                known.reloading = False
            default = entry.config.default_precision
            if default not in versions:
                await self._close(versions)
                if not first:  # the old versions' series serve on; the new refusals' go
                    for version in refused:
                        if version not in known.refused:
                            model_available(name, version)
                why = refused.get(default, "it did not load")
                self._failed(name, known, first, files, f"version {default!r}: {why}", entry)
                on = "" if first else "; the versions loaded before serve on"
                raise BadRequest(f"model {name!r} did not load: version {default!r}: {why}{on}")
            # No local keeps the versions it replaces: once retired they can be freed.
            await self._retire(name, self._settle(known, entry, versions, refused), versions)
            if first:  # nothing retired (whose release_memory freezes): what it made, now
                await asyncio.to_thread(freeze_heap)
            known.files = files
            if generated:
                known.files = await asyncio.to_thread(fingerprint, entry.folder)
        log.info("model %s: serving %s", name, ", ".join(sorted(versions)))

    def _failed(
        self,
        name: str,
        known: Known,
        first: bool,
        files: Files,
        why: str,
        entry: ModelEntry | None = None,
    ) -> None:
        """A load that did not switch: a first one leaves the model unavailable with why; a
        reload leaves the old versions serving and says why beside them."""
        known.files = files  # poll mode tries again once the files change, not every poll
        if first:
            known.state, known.reason, known.loading = UNAVAILABLE, f"load failed: {why}", None
            if entry is not None:
                known.entry = entry
        else:
            known.last_failure = why
        self.generation += 1
        log.error("model %s did not load: %s", name, why)

    async def _close(self, versions: dict[str, LoadedModel]) -> None:
        """Close versions that never served (a load that failed) and free their memory."""
        await asyncio.gather(*(model.close() for model in versions.values()))
        versions.clear()
        await asyncio.to_thread(release_memory)

    async def _retire(
        self, name: str, old: dict[str, LoadedModel], new: dict[str, LoadedModel]
    ) -> None:
        """The versions a reload replaced: what they queued runs to its answer (within the
        drain timeout), then they are freed and their memory handed back; a version the new
        config dropped loses its metrics."""
        if not old:
            return
        timeout = self.settings.server.drain_timeout_s
        await asyncio.gather(
            *(
                model.close(timeout, f"model {name!r} version {version!r} is no longer served")
                for version, model in old.items()
            )
        )
        for version in old:
            if version not in new:
                old[version].metrics.forget()
        old.clear()
        await asyncio.to_thread(release_memory)

    async def unload(self, name: str) -> None:
        """Unload model ``name``: new requests get 503 at once, the requests it queued run to
        their answer (those left after the drain timeout get 503), then its runners, engines
        and metrics go, and their memory back to the system. Unloading a model that is not
        loaded does nothing."""
        known = self._known.get(name)
        if known is None:
            if model_folder(self.settings.models.repository, name) is None:
                self._not_a_model(name)
            return
        async with known.lock:
            if known.state in (UNAVAILABLE, UNLOADING):
                return
            known.state = UNLOADING
            self.generation += 1
            log.info("model %s: unloading %s", name, ", ".join(sorted(known.versions)))
            try:
                await asyncio.gather(
                    *(
                        model.close(
                            self.settings.server.drain_timeout_s, f"model {name!r} is unloaded"
                        )
                        for model in known.versions.values()
                    )
                )
            finally:
                for version in known.versions:
                    known.versions[version].metrics.forget()
                for version in known.refused:
                    model_available(name, version)
                known.versions, known.refused = {}, {}  # the last references to them
                known.state, known.reason, known.last_failure = UNAVAILABLE, "unloaded", ""
                self.generation += 1
            await asyncio.to_thread(release_memory)
        log.info("model %s: unloaded", name)

    async def remove(self, name: str) -> None:
        """Poll mode, a model whose folder is gone: unloaded, then forgotten, so that it
        answers 404 and leaves the index (and a folder put back is a new model)."""
        known = self._known.get(name)
        if known is None:
            return
        await self.unload(name)
        async with known.lock:
            if self._known.get(name) is not known or model_folder(
                self.settings.models.repository, name
            ):
                return  # put back (or loaded again) meanwhile: it is a model again
            entry = known.entry or known.loading
            for version in entry.config.precisions if entry is not None else ():
                model_available(name, version)  # a first load's refusals leave no series
            del self._known[name]
            self.generation += 1
        log.info("model %s: its folder is gone; forgotten", name)

    def known_files(self) -> dict[str, Files | None]:
        """Per known model, its files when it was last loaded (poll mode:
        ``app.engine.watch``)."""
        return {name: known.files for name, known in self._known.items()}

    # -- state

    @property
    def ready(self) -> bool:
        served = self.loaded()
        return (
            self.loading_done and (bool(served) or self.controlled) and all(m.ready for m in served)
        )

    @property
    def healthy(self) -> bool:
        """False once a version stopped on an unrecoverable engine fault."""
        return all(m.ready for m in self.loaded())

    def loaded(self) -> list[LoadedModel]:
        """The versions that serve (not those of a model being unloaded)."""
        return [
            model
            for known in self._known.values()
            if known.state == READY
            for model in known.versions.values()
        ]

    def get(self, name: str, version: str | None = None) -> LoadedModel:
        """The loaded version; 404 for an unknown model or version, 503 with the reason for
        one that is refused, loading, unloading or unloaded."""
        known = self._known.get(name)
        if known is None:
            if self.controlled and model_folder(self.settings.models.repository, name):
                raise Unavailable(f"model {name!r} is not loaded")
            raise NotFound(f"unknown model '{client_text(name)}'")
        return served_version(name, known, version)

    def versions(self, name: str) -> list[str]:
        """The versions of a model that serve."""
        known = self._known.get(name)
        return list(known.versions) if known is not None and known.state == READY else []

    def unavailable(self, name: str) -> dict[str, str]:
        """The versions of a model that are configured but not served, with the reason."""
        known = self._known.get(name)
        return dict(known.refused) if known is not None and known.state == READY else {}

    async def index(self) -> list[dict[str, str]]:
        """Triton's repository index: every version of every known model with its state
        (READY, LOADING, UNLOADING, UNAVAILABLE) and, where there is one, the reason; with
        model control, the repository's other models too, UNAVAILABLE: not loaded (their
        configs read in a thread)."""
        index = []
        for name, known in self._known.items():
            index.extend(index_items(name, known))
        if self.controlled:
            names = set(self._known)
            index.extend(await asyncio.to_thread(not_loaded, self.settings.models, names))
        return index

    def default(self, name: str | None) -> LoadedModel:
        """The model of the plain ``POST /infer``: ``name``, else the first model that
        serves; else the first, whose 503 then says why not."""
        if name is None:
            if not self._known:
                raise Unavailable("no model is loaded")
            served = [n for n, k in self._known.items() if k.state == READY and k.versions]
            name = served[0] if served else next(iter(self._known))
        return self.get(name)
