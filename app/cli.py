"""``stoker``: serve, prepare and list models. ``python -m app`` is the same command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from app.settings import Settings

log = logging.getLogger("stoker")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="stoker",
        description="Serve ONNX models over KServe V2 with dynamic batching. Every option "
        "can also be set by environment (STOKER_SERVER__PORT, STOKER_MODELS__REPOSITORY, ...).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def add_repository_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--repository", type=Path, help="model repository folder")
        sub.add_argument(
            "--model", action="append", dest="models", help="model to use (repeatable)"
        )

    serve = commands.add_parser("serve", help="serve the model repository over HTTP and gRPC")
    add_repository_options(serve)
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port (default 8001; 0: no gRPC)")
    serve.add_argument("--backend", help="override every model's backend (auto, onnxruntime)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--front-ends",
        type=int,
        help="HTTP front-end processes before one engine process (default 1: one process)",
    )
    serve.add_argument(
        "--model-control-mode",
        choices=["none", "explicit", "poll"],
        help="none (default): the models are fixed at start; explicit: loaded and unloaded "
        "over the API (stoker models --load/--unload); poll: reloaded when their files change",
    )
    serve.add_argument(
        "--load-model",
        action="append",
        dest="startup",
        help="explicit mode: a model loaded at start (repeatable; default: as the other modes)",
    )

    prepare = commands.add_parser(
        "prepare", help="generate the missing ONNX files of the repository's models, offline"
    )
    add_repository_options(prepare)

    build = commands.add_parser(
        "build",
        help="prepare, calibrate and build every configured precision into the engine store, "
        "then exit (e.g. in an init container)",
    )
    add_repository_options(build)
    build.add_argument("--backend", help="the backend to build for (default: as configured)")

    accuracy = tool("accuracy")
    if accuracy is not None:
        report = commands.add_parser(
            "accuracy",
            help="measure each precision against fp32 on labelled photos (Markdown and PNG)",
        )
        accuracy.add_arguments(report)

    listing = commands.add_parser(
        "models",
        help="list the repository's models; with --load, --unload or --index, ask a running "
        "server (models.control explicit) instead",
    )
    add_repository_options(listing)
    listing.add_argument(
        "--load", action="append", default=[], metavar="NAME", help="load or reload a model"
    )
    listing.add_argument("--unload", action="append", default=[], metavar="NAME")
    listing.add_argument("--index", action="store_true", help="print the server's model index")
    listing.add_argument(
        "--config",
        type=Path,
        help="with one --load: a config file (YAML or JSON) used in place of its config.yaml",
    )
    listing.add_argument(
        "--url", help="the server (default http://127.0.0.1:<server.port>, STOKER_SERVER__PORT)"
    )
    listing.add_argument(
        "--api-key",
        help="the key to send (default: STOKER_API_KEY, else the first of the server's "
        "configured keys, STOKER_AUTH__API_KEYS or its file)",
    )
    listing.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a load may take (default 600)"
    )
    # Parsed by bench.cli (main hands it everything after "bench"); listed here for --help.
    commands.add_parser("bench", help="load-test V2 servers (stoker bench --help)")
    return parser.parse_args(argv)


def build_settings(args: argparse.Namespace) -> Settings:
    """Environment first, command-line options on top."""
    settings = Settings()
    overrides: dict[str, dict[str, Any]] = {
        "server": {
            "host": getattr(args, "host", None),
            "port": getattr(args, "port", None),
            "grpc_port": getattr(args, "grpc_port", None),
            "log_level": getattr(args, "log_level", None),
            "front_ends": getattr(args, "front_ends", None),
        },
        "models": {
            "repository": args.repository,
            "models": getattr(args, "models", None),
            "backend": getattr(args, "backend", None),
            "control": getattr(args, "model_control_mode", None),
            "startup": getattr(args, "startup", None),
        },
    }
    merged = settings.model_dump()
    for section, values in overrides.items():
        merged[section].update({k: v for k, v in values.items() if v is not None})
    if overrides["server"]["front_ends"] is not None:
        from app import settings as settings_module

        settings_module.AUTO_FRONT_ENDS = None  # ``auto`` was the default's, not what serves
    return Settings.model_validate(merged)


def serve(settings: Settings) -> int:
    from app import settings as settings_module

    if settings_module.AUTO_FRONT_ENDS is not None:
        log.info("%s", settings_module.AUTO_FRONT_ENDS)
    if settings.server.front_ends > 1 or settings.server.engine_gpus:
        from app.processes import serve_processes

        log.info("settings: %s", json.dumps(settings.loggable()))
        return serve_processes(settings)
    from app.frontend.server import create_app
    from app.processes import run_server

    log.info("settings: %s", json.dumps(settings.loggable()))
    return run_server(settings, lambda on_fatal: create_app(settings, on_fatal=on_fatal))


def prepare(settings: Settings) -> int:
    from app.engine.models import prepare as prepare_model
    from app.engine.repository import discover

    for entry in discover(settings.models.repository, settings.models.models):
        if entry.onnx_path.exists():
            print(f"{entry.config.name}: {entry.onnx_path} exists")
            continue
        if entry.config.generator is None:
            print(f"{entry.config.name}: {entry.onnx_path} is missing and has no generator")
            return 1
        print(f"{entry.config.name}: generating {entry.onnx_path} ...", flush=True)
        prepare_model(entry)
        print(f"{entry.config.name}: done")
    return 0


def build_engines(settings: Settings) -> int:
    """What startup does before serving, ahead of time: every precision of every model is
    built (or found) in the engine store, with progress in the log."""
    from app.engine import models
    from app.engine.repository import discover
    from engines import backends
    from engines.precision.build import AccuracyBudgetExceeded
    from engines.store import EngineStore

    if prepare(settings) != 0:
        return 1
    store = EngineStore(settings.store.path)
    failed = False
    for entry in discover(settings.models.repository, settings.models.models):
        backend = backends.resolve(settings.models.backend or entry.config.backend)
        model = models.source(entry)
        for precision in entry.config.precisions:
            try:
                path, report, _ = models.build(model, precision, backend, store)
                facts = ", ".join(f"{k} {v:.4g}" for k, v in report.items())
                print(
                    f"{entry.config.name} {precision} ({backend}): {path}"
                    + (f" [{facts}]" if facts else "")
                )
                if backend == "tensorrt":
                    print(models.prebuild_tensorrt(model, precision, path, store))
            except AccuracyBudgetExceeded as exc:
                print(f"{entry.config.name} {precision}: REFUSED: {exc}")
                failed = True
            except Exception as exc:
                # As the server does with a version that fails to load: say so, go on.
                print(f"{entry.config.name} {precision}: FAILED: {type(exc).__name__}: {exc}")
                failed = True
    if failed and not settings.models.exit_on_error:
        # As the server does: a refused version answers 503 and the others serve, so an init
        # container that pre-builds the store must not keep the pod from starting.
        print(
            "the refused versions will answer 503 with the reason when served; set "
            "STOKER_MODELS__EXIT_ON_ERROR=1 to make a refusal fail this command"
        )
        return 0
    return 1 if failed else 0


def list_models(settings: Settings) -> int:
    """The repository's models, and per precision what the engine store holds for this CPU:
    built, refused (and why: such a version answers 503 when served) or not built yet."""
    from app.engine.models import model_spec
    from app.engine.repository import discover
    from engines import backends
    from engines.precision.build import variant_state
    from engines.store import EngineStore

    store = EngineStore(settings.store.path)
    for entry in discover(settings.models.repository, settings.models.models):
        config = entry.config
        state = "ready to load" if entry.onnx_path.exists() else "ONNX missing"
        backend = backends.resolve(settings.models.backend or config.backend)
        print(
            f"{config.name:24} precisions={','.join(config.precisions):12} "
            f"max_batch={config.max_batch_size:<4} runners={config.runner_count(backend)} "
            f"{state}"
        )
        if not entry.onnx_path.exists():
            continue
        plan = entry.build_plan(model_spec(entry))
        for precision in config.precisions:
            print(f"  {precision:6} {backend}: {variant_state(store, plan, precision, backend)}")
    return 0


def control_models(settings: Settings, args: argparse.Namespace) -> int:
    """``stoker models --load/--unload/--index``: the model control endpoints of a running
    server, called as a client would (``POST /v2/repository/...``), in the order given."""
    from app import control

    if args.config is not None and len(args.load) != 1:
        print("stoker: --config goes with exactly one --load", file=sys.stderr)
        return 2
    url = args.url or f"http://127.0.0.1:{settings.server.port}"
    key = args.api_key or os.environ.get("STOKER_API_KEY")
    if key is None:
        key = next(iter(settings.auth.keys()), None)
    client = control.Client(url, key, args.timeout)
    try:
        for name in args.load:
            client.load(name, control.read_config(args.config) if args.config else None)
            print(f"{name}: loaded")
        for name in args.unload:
            client.unload(name)
            print(f"{name}: unloaded")
        if args.index:
            for item in client.index():
                reason = f"  ({item['reason']})" if item.get("reason") else ""
                print(
                    f"{item['name']:24} {item.get('version', ''):6} {item.get('state', '')}{reason}"
                )
    except control.ControlError as error:
        print(f"stoker: {error}", file=sys.stderr)
        return 1
    return 0


def tool(name: str) -> Any:
    """A tooling command's module, as the tooling registers it (the ``stoker.tools`` entry
    points: ``bench/`` is tooling, and the service never imports it by name); None where it
    is not installed."""
    found = [ep for ep in entry_points(group="stoker.tools") if ep.name == name]
    return found[0].load() if found else None


# How a source checkout that was not installed (no entry point names the tools) runs each
# tool: ``python -m bench`` reaches them without one.
FROM_SOURCE = {"bench": "python -m bench", "accuracy": "python -m bench accuracy"}


def settings_for(args: argparse.Namespace) -> Settings:
    """A command's settings (environment first, its options on top), with the log set up as
    they say; invalid settings end the command with one line."""
    try:
        settings = build_settings(args)
    except ValueError as exc:
        print(f"stoker: invalid settings: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(
        level=settings.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # ONNX Runtime's quantizer logs each scale it adjusts on the root logger: hundreds of
    # lines per INT8 build that bury the progress lines. Keep its warnings.
    logging.getLogger().addFilter(
        lambda record: record.levelno >= logging.WARNING or "onnxruntime" not in record.pathname
    )
    return settings


def run_tool(
    command: Callable[[argparse.Namespace, Settings], int], args: argparse.Namespace
) -> int:
    """A tooling command (``stoker accuracy``, or ``python -m bench accuracy`` from a source
    checkout) with the service's settings and log; a config error (an unknown model, a bad
    config.yaml) is one line, not a traceback."""
    from app.engine.folders import ConfigError

    settings = settings_for(args)
    try:
        code = command(args, settings)
    except ConfigError as exc:
        print(f"stoker: {exc}", file=sys.stderr)
        return 2
    return code


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    module: Any = None
    if arguments[:1] and arguments[0] in FROM_SOURCE:
        name = arguments[0]
        module = tool(name)
        if module is None:
            print(
                f"stoker: the {name} tool is not installed (pip install -e . from the project "
                f"folder); from the source checkout: {FROM_SOURCE[name]} ...",
                file=sys.stderr,
            )
            return 2
        if name == "bench":
            code: int = module.main(arguments[1:])
            return code
    args = parse_args(argv)
    if args.command == "accuracy":
        return run_tool(module.run, args)
    from app.engine.folders import ConfigError

    settings = settings_for(args)
    if args.command == "models" and (args.load or args.unload or args.index):
        return control_models(settings, args)
    commands = {
        "serve": serve,
        "prepare": prepare,
        "build": build_engines,
        "models": list_models,
    }
    try:
        return commands[args.command](settings)
    except ConfigError as exc:
        print(f"stoker: {exc}", file=sys.stderr)
        return 2
