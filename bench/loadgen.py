"""The load generator: client worker processes that run timed steps against one target.

A target is a V2 server over HTTP (``bench.http_wire``'s lean client, or aiohttp's; one
kept-alive connection per concurrent client), over gRPC
(``bench.grpc_client``: one channel and connection per request in flight, serialized
requests sent as they are, answers not parsed, as the HTTP client does with bodies), or
Stoker's batcher and runner pool loaded in the worker itself (``in-process``: the raw-runner
baseline, no HTTP, no codec), or the model's runner called directly (``bench.direct``). One
asyncio client on one core tops out at a few thousand requests/s, so ``workers`` processes
share each step's clients (or arrival rate) and their samples are merged: the generator must
never be the bottleneck it measures.

A step is closed loop (``concurrency`` clients, each sending its next request when the last
is answered) or open loop (Poisson arrivals at ``rate`` requests/s, latency counted from
each request's scheduled time so a slow client cannot hide queueing). Every step warms up,
then measures for ``duration_s``; every worker starts its step at the same wall-clock
instant.

Kept in one module (~600 lines): the step, the HTTP and in-process clients, the recorder and
the worker protocol change together whenever what a step measures changes; none of it is on
the service's request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import random
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from bench.answers import check, decode
from bench.direct import DirectClient, DirectTarget
from bench.grpc_client import GrpcClient, GrpcTarget
from bench.http_wire import RawHttpClient
from bench.payloads import Payload
from bench.scrape import ServerStats, step_stats

if TYPE_CHECKING:
    from app.engine.models import LoadedModel

Mode = Literal["closed", "open"]
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}
# Time for every worker to receive a step before it starts at the same instant.
START_MARGIN_S = 0.25


@dataclass(frozen=True)
class Step:
    mode: Mode
    concurrency: int = 0
    rate: float = 0.0
    warmup_s: float = 1.0
    duration_s: float = 5.0


@dataclass(frozen=True)
class HttpTarget:
    """A V2 server: requests go to ``url + path``; ``/metrics`` is read at ``url``."""

    url: str
    path: str
    timeout_s: float = 60.0
    client: Literal["raw", "aiohttp"] = "raw"
    """Who sends the requests: ``bench.http_wire``'s lean client, or aiohttp's."""


@dataclass(frozen=True)
class InProcessTarget:
    """Stoker's batcher and runner pool for one model, loaded in the worker process."""

    repository: Path
    model: str
    backend: str | None = None
    precision: str | None = None
    """The version to serve (default: the model's default precision), its variant taken
    from the engine store (``STOKER_STORE__PATH``) or built into it, as the server does."""


Target = HttpTarget | GrpcTarget | InProcessTarget | DirectTarget


@dataclass(frozen=True)
class Share:
    """One worker's part of a step."""

    step: Step
    clients: int
    rate: float
    start_at: float
    scrape: bool
    seed: int
    max_in_flight: int


@dataclass
class Samples:
    """What one worker measured in one step's window."""

    latencies: np.ndarray
    completed: int
    rows: int
    statuses: dict[str, int]
    cpu_s: float
    metrics_before: str | None = None
    metrics_after: str | None = None


@dataclass
class StepResult:
    """One step over every worker: the full latency samples summarised, nothing averaged."""

    step: Step
    requests: int
    rows: int
    throughput: float
    rows_per_s: float
    latency_ms: dict[str, float | None]
    statuses: dict[str, int]
    client_cpu: float
    server: ServerStats = field(default_factory=ServerStats)

    @property
    def errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if not status.startswith("2"))

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.step.mode,
            "concurrency": self.step.concurrency,
            "offered_rate": self.step.rate,
            "warmup_s": self.step.warmup_s,
            "duration_s": self.step.duration_s,
            "requests": self.requests,
            "rows": self.rows,
            "throughput": self.throughput,
            "rows_per_s": self.rows_per_s,
            "latency_ms": self.latency_ms,
            "statuses": self.statuses,
            "errors": self.errors,
            "client_cpu_cores": self.client_cpu,
            "server": self.server.as_json(),
        }


def summarize(latencies_s: np.ndarray) -> dict[str, float | None]:
    """Percentiles, mean and max in milliseconds from every sample (no histogram binning)."""
    if latencies_s.size == 0:
        return {name: None for name in (*PERCENTILES, "mean", "max")}
    ms = latencies_s * 1e3
    summary: dict[str, float | None] = {
        name: float(np.percentile(ms, q)) for name, q in PERCENTILES.items()
    }
    summary["mean"] = float(ms.mean())
    summary["max"] = float(ms.max())
    return summary


def merge(
    step: Step, parts: list[Samples], model: str | None = None, version: str | None = None
) -> StepResult:
    latencies = np.concatenate([p.latencies for p in parts]) if parts else np.empty(0)
    statuses: Counter[str] = Counter()
    for part in parts:
        statuses.update(part.statuses)
    completed = sum(p.completed for p in parts)
    rows = sum(p.rows for p in parts)
    scraped = next((p for p in parts if p.metrics_after is not None), None)
    server = (
        step_stats(scraped.metrics_before, scraped.metrics_after, model, version)
        if scraped
        else ServerStats()
    )
    return StepResult(
        step=step,
        requests=completed,
        rows=rows,
        throughput=completed / step.duration_s,
        rows_per_s=rows / step.duration_s,
        latency_ms=summarize(latencies),
        statuses=dict(sorted(statuses.items())),
        client_cpu=sum(p.cpu_s for p in parts) / step.duration_s,
        server=server,
    )


def split(total: int, parts: int) -> list[int]:
    """``total`` clients over ``parts`` workers, as evenly as possible."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# -- in the worker process ----------------------------------------------------------------


class Client(Protocol):
    async def send(self, payload: Payload) -> int | str:
        """The answer's status, or ``bench.answers.WRONG`` for a 2xx answer that is not the
        payload's ``expected`` one."""
        ...

    async def metrics(self) -> str | None: ...

    async def close(self) -> None: ...


class HttpClient:
    def __init__(self, target: HttpTarget) -> None:
        import aiohttp

        self._endpoint = target.url.rstrip("/") + target.path
        self._metrics_url = target.url.rstrip("/") + "/metrics"
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=target.timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
        )
        self._raw = (
            RawHttpClient(target.url, target.path, target.timeout_s)
            if target.client == "raw"
            else None
        )

    async def send(self, payload: Payload) -> int | str:
        if self._raw is not None:
            return await self._raw.send(payload)
        async with self._session.post(
            self._endpoint, data=payload.body, headers=payload.headers
        ) as response:
            body = await response.read()
            if payload.expected is None:
                return response.status
            length = response.headers.get("Inference-Header-Content-Length")
            read = partial(decode, body, None if length is None else int(length))
            return check(payload, response.status, read)

    async def metrics(self) -> str | None:
        import aiohttp

        try:
            async with self._session.get(self._metrics_url) as response:
                if response.status != 200:
                    return None
                return await response.text()
        except aiohttp.ClientError:
            return None

    async def close(self) -> None:
        if self._raw is not None:
            await self._raw.close()
        await self._session.close()


class InProcessClient:
    """Requests go straight into Stoker's batcher: what the service costs on top of this is
    HTTP and the codec. Uploads are decoded by the model's own handler first (its device
    decoder gathers concurrent ones, as in the engine), so for JPEG this is the in-process
    decode, resize and infer pipeline."""

    def __init__(
        self,
        model: LoadedModel,
        timeout_s: float | None,
        keys: dict[int, tuple[Any, dict[str, np.ndarray]]],
        top_k: int = 5,
    ) -> None:
        """``keys``: per tensor payload (by id), its batch key and its tensors as the engine
        takes them; uploads are not in it. ``top_k``: the labels an upload's answer has (the
        server's ``limits.default_top_k``)."""
        self._model = model
        self._top_k = top_k
        self._timeout_s = timeout_s
        self._keys = keys

    @classmethod
    async def load(cls, target: InProcessTarget, payloads: list[Payload]) -> InProcessClient:
        from app.contract import batch_key, validate_inputs
        from app.engine import models
        from app.engine.repository import discover
        from app.settings import Settings
        from engines import backends
        from engines.store import EngineStore

        entry = discover(target.repository, [target.model])[0]
        config = entry.config
        settings = Settings()
        model = await asyncio.to_thread(models.source, entry)
        backend = backends.resolve(target.backend or config.backend)
        precision = target.precision or config.default_precision
        store = EngineStore(settings.store.path)
        loaded = await models.load(model, precision, backend, store, settings)
        keys = {}
        for payload in payloads:
            if payload.images:
                if loaded.handler is None:
                    raise ValueError(f"model {target.model!r} does not take image uploads")
                continue
            if payload.tensors is None:
                raise ValueError("in-process payloads are tensors or images, not HTTP bodies")
            validate_inputs(model.spec, payload.tensors, loaded.inputs.pixels)
            # What the service does to UINT8 pixels before batching, done once up front.
            tensors = loaded.inputs.for_engine(payload.tensors)
            keys[id(payload)] = (batch_key(model.spec, tensors), tensors)
        timeout_us = config.dynamic_batching.default_timeout_us
        timeout_s = timeout_us / 1e6 if timeout_us else None
        return cls(loaded, timeout_s, keys, settings.limits.default_top_k)

    async def send(self, payload: Payload) -> int:
        from app.contract import batch_key
        from app.errors import StokerError

        model = self._model
        try:
            if payload.images and model.handler is not None:
                inputs = await model.handler.decode(payload.images)
                key = batch_key(model.spec, inputs)
                out = await model.batcher.infer(inputs, payload.rows, key, self._timeout_s)
                model.handler.encode(out, self._top_k)
            else:
                key, tensors = self._keys[id(payload)]
                await model.batcher.infer(tensors, payload.rows, key, self._timeout_s)
        except StokerError as exc:
            return exc.status
        return 200

    async def metrics(self) -> str | None:
        from prometheus_client import generate_latest

        return generate_latest().decode()

    async def close(self) -> None:
        await self._model.close(5.0)


class Recorder:
    """Counts outcomes; keeps the latency of every successful request in the window."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.completed = 0
        self.rows = 0
        self.statuses: Counter[str] = Counter()

    def outcome(self, status: str, rows: int, latency: float | None, completed: bool) -> None:
        ok = status.startswith("2")
        if latency is not None:
            self.statuses[status] += 1
            if ok:
                self.latencies.append(latency)
        if completed and ok:
            self.completed += 1
            self.rows += rows


async def attempt(client: Client, payload: Payload) -> str:
    try:
        return str(await client.send(payload))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return f"error:{type(exc).__name__}"


async def sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def closed_loop(
    client: Client, payloads: list[Payload], share: Share, t0: float, t1: float, rec: Recorder
) -> None:
    async def one_client(index: int) -> None:
        turn = index
        while time.perf_counter() < t1:
            payload = payloads[turn % len(payloads)]
            turn += share.clients
            start = time.perf_counter()
            status = await attempt(client, payload)
            end = time.perf_counter()
            in_window = t0 <= end < t1
            rec.outcome(status, payload.rows, end - start if in_window else None, in_window)

    # Workers start at different payloads, so together they cycle through all of them.
    await asyncio.gather(*(one_client(share.seed + i) for i in range(share.clients)))


async def open_loop(
    client: Client,
    payloads: list[Payload],
    share: Share,
    start: float,
    t0: float,
    t1: float,
    rec: Recorder,
) -> None:
    """Poisson arrivals; a request's latency runs from its scheduled arrival, and requests
    that arrived in the window are waited for even when they finish after it."""
    rng = random.Random(share.seed)
    in_flight: set[asyncio.Task[None]] = set()

    async def one(intended: float, payload: Payload) -> None:
        status = await attempt(client, payload)
        end = time.perf_counter()
        arrived_in_window = t0 <= intended < t1
        rec.outcome(
            status,
            payload.rows,
            end - intended if arrived_in_window else None,
            t0 <= end < t1,
        )

    arrival, turn = start, share.seed
    while share.rate > 0:
        arrival += rng.expovariate(share.rate)
        if arrival >= t1:
            break
        await sleep_until(arrival)
        if len(in_flight) >= share.max_in_flight:
            if t0 <= arrival < t1:
                rec.statuses["client-overflow"] += 1
            continue
        task = asyncio.create_task(one(arrival, payloads[turn % len(payloads)]))
        turn += 1
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.gather(*in_flight)


async def run_share(client: Client, payloads: list[Payload], share: Share) -> Samples:
    start = time.perf_counter() + (share.start_at - time.time())
    t0 = start + share.step.warmup_s
    t1 = t0 + share.step.duration_s
    rec = Recorder()
    scraped: dict[str, str | None] = {}
    cpu: dict[str, float] = {}

    async def watch() -> None:
        await sleep_until(t0)
        cpu["t0"] = time.process_time()
        if share.scrape:
            scraped["before"] = await client.metrics()
        await sleep_until(t1)
        cpu["t1"] = time.process_time()
        if share.scrape:
            scraped["after"] = await client.metrics()

    watcher = asyncio.create_task(watch())
    await sleep_until(start)
    if share.step.mode == "closed":
        if isinstance(client, DirectClient):
            await client.closed_loop(payloads, share.clients, share.seed, t0, t1, rec.outcome)
        elif share.clients:
            await closed_loop(client, payloads, share, t0, t1, rec)
    else:
        await open_loop(client, payloads, share, start, t0, t1, rec)
    await watcher
    return Samples(
        latencies=np.asarray(rec.latencies, dtype=np.float64),
        completed=rec.completed,
        rows=rec.rows,
        statuses=dict(rec.statuses),
        cpu_s=cpu["t1"] - cpu["t0"],
        metrics_before=scraped.get("before"),
        metrics_after=scraped.get("after"),
    )


async def serve_steps(connection: Connection, target: Target, payloads: list[Payload]) -> None:
    client: Client
    if isinstance(target, HttpTarget):
        client = HttpClient(target)
    elif isinstance(target, GrpcTarget):
        client = GrpcClient(target)
    elif isinstance(target, DirectTarget):
        client = await DirectClient.load(target, payloads)
    else:
        client = await InProcessClient.load(target, payloads)
    loop = asyncio.get_running_loop()
    try:
        connection.send(("ready", None))
        while (share := await loop.run_in_executor(None, connection.recv)) is not None:
            connection.send(("samples", await run_share(client, payloads, share)))
    finally:
        await client.close()


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def worker_main(connection: Connection, target: Target, payloads: list[Payload]) -> None:
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(serve_steps(connection, target, payloads))
    except Exception:
        with contextlib.suppress(OSError):
            connection.send(("failed", traceback.format_exc()))


# -- in the coordinating process ----------------------------------------------------------


class WorkerFailed(RuntimeError):
    pass


class Workers:
    """Client processes for one target, kept for every step so connections stay warm."""

    def __init__(
        self,
        target: Target,
        payloads: list[Payload],
        count: int,
        max_in_flight: int = 16384,
        model: str | None = None,
        version: str | None = None,
    ) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._max_in_flight = max_in_flight
        self._model = model
        self._version = version
        self._seed = 0
        self._connections: list[Connection] = []
        self._processes: list[Any] = []
        for _ in range(count):
            mine, theirs = self._context.Pipe()
            process = self._context.Process(
                target=worker_main, args=(theirs, target, payloads), daemon=True
            )
            process.start()
            theirs.close()
            self._connections.append(mine)
            self._processes.append(process)
        try:
            for connection in self._connections:
                self._receive(connection)
        except BaseException:
            self.close()
            raise

    def _receive(self, connection: Connection) -> Any:
        try:
            kind, value = connection.recv()
        except EOFError:
            raise WorkerFailed("a client worker exited without a word") from None
        if kind == "failed":
            raise WorkerFailed(f"a client worker failed:\n{value}")
        return value

    def run(self, step: Step) -> StepResult:
        count = len(self._connections)
        clients = split(step.concurrency, count)
        start_at = time.time() + START_MARGIN_S
        for i, connection in enumerate(self._connections):
            self._seed += 1
            connection.send(
                Share(
                    step=step,
                    clients=clients[i],
                    rate=step.rate / count,
                    start_at=start_at,
                    scrape=i == 0,
                    seed=self._seed,
                    max_in_flight=max(1, self._max_in_flight // count),
                )
            )
        parts = [self._receive(connection) for connection in self._connections]
        return merge(step, parts, self._model, self._version)

    def close(self) -> None:
        for connection in self._connections:
            with contextlib.suppress(OSError):
                connection.send(None)
        for process in self._processes:
            process.join(timeout=15)
            if process.is_alive():
                process.terminate()
                process.join()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
