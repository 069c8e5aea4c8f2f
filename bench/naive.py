"""The naive baseline server: the FastAPI wrapper most teams write first.

One inference per request, no batching: each request runs alone on the same backend and the
same model Stoker serves, through one runner given every core, one request at a time (a
runner is never used by two threads at once). It speaks the subset of V2 the bench uses
(health, model metadata, JSON and binary ``infer``) and ``POST /infer`` with images, so
``stoker bench --naive`` measures what dynamic batching is worth in one command.

``python -m bench.naive --repository models --model efficientnet_lite0 --port 8001``
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request, Response

from app.contract import requested_outputs, validate_inputs
from app.engine import models
from app.engine.handlers import Handler, check_uploads, handler_for
from app.engine.repository import discover
from app.errors import BadRequest, NotFound, StokerError
from app.frontend.routes import header_length, json_response, uploaded_images
from app.metrics import ModelMetrics
from app.protocol import classify, decode_request, encode_response
from app.settings import Settings
from engines import backends
from engines.base import Runner
from engines.spec import ModelSpec
from engines.store import EngineStore


@dataclass
class Model:
    spec: ModelSpec
    runner: Runner
    executor: ThreadPoolExecutor
    labels: list[str] | None
    inputs: models.InputPolicy
    uploads: Handler | None
    settings: Settings

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.runner.run, inputs)


def load(repository: Path, name: str, backend: str | None) -> Model:
    """The model as Stoker loads it (``app.engine.models``), with one runner and no batcher."""
    settings = Settings()
    entry = discover(repository, [name], settings.models)[0]
    model = models.source(entry)
    chosen = backends.resolve(backend or entry.config.backend)
    store = EngineStore(settings.store.path)
    # The precision Stoker serves by default, so the two run the same engine.
    precision = entry.config.default_precision
    engine, policy = models.load_engine(model, precision, chosen, store, runners=1)
    labels = entry.labels()
    metrics = ModelMetrics(f"naive-{entry.config.name}", precision)
    context = models.handler_context(model, labels, settings, metrics, policy)
    uploads = handler_for(entry.config.handler, context, settings.models.handlers)
    runner = engine.new_runner()
    return Model(
        model.spec, runner, ThreadPoolExecutor(1, "naive"), labels, policy, uploads, settings
    )


def create_app(repository: Path, name: str, backend: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        model = await asyncio.to_thread(load, repository, name, backend)
        app.state.model = model
        yield
        model.executor.shutdown(wait=True)
        model.runner.close()

    app = FastAPI(title="naive baseline", lifespan=lifespan)

    async def stoker_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StokerError)
        return json_response({"error": exc.message}, exc.status)

    app.add_exception_handler(StokerError, stoker_error)

    def served(request: Request, model_name: str | None) -> Model:
        model: Model = request.app.state.model
        if model_name is not None and model_name != model.spec.name:
            raise NotFound(f"unknown model {model_name!r}")
        return model

    @app.get("/v2/health/live")
    @app.get("/v2/health/ready")
    async def health() -> Response:
        return json_response({"ready": True})

    @app.get("/v2/models/{model_name}")
    @app.get("/v2/models/{model_name}/versions/{version}")
    async def metadata(request: Request, model_name: str, version: str | None = None) -> Response:
        spec = served(request, model_name).spec
        return json_response(spec.metadata([], "naive"))

    @app.post("/v2/models/{model_name}/infer")
    @app.post("/v2/models/{model_name}/versions/{version}/infer")
    async def infer(request: Request, model_name: str, version: str | None = None) -> Response:
        model = served(request, model_name)
        body = await request.body()
        decoded = decode_request(body, header_length(request), model.spec)
        validate_inputs(model.spec, decoded.inputs, model.inputs.pixels)
        inputs = model.inputs.for_engine(decoded.inputs)
        outputs = await model.run(inputs)
        answer = [
            (
                out,
                classify(outputs[out.name], out.classification, model.labels)
                if out.classification
                else outputs[out.name],
            )
            for out in requested_outputs(model.spec, decoded)
        ]
        content, headers = encode_response(model.spec.name, "naive", decoded.id, answer)
        return Response(content, headers=headers)

    @app.post("/infer")
    @app.post("/v2/models/{model_name}/classify")
    async def classify_upload(
        request: Request, model_name: str | None = None, k: int = 5
    ) -> Response:
        model = served(request, model_name)
        if model.uploads is None:
            raise BadRequest(f"model {model.spec.name!r} does not take image uploads")
        uploads, _ = await uploaded_images(request, model.settings.limits.max_images_per_request)
        check_uploads(uploads, model.settings.limits)
        inputs = await model.uploads.decode(uploads)
        outputs = await model.run(inputs)
        predictions = model.uploads.encode(outputs, k)
        return json_response({"model_name": model.spec.name, "predictions": predictions})

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m bench.naive", description="the naive one-request-one-inference server"
    )
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--backend")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    app = create_app(args.repository, args.model, args.backend)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
