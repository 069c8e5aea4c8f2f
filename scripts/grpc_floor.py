"""What grpc.aio itself costs a server per call, with nothing of Stoker's: a bare echo server
(uvloop, as the front ends run) answering 200-byte messages, measured as its process's CPU
per answered message while a closed loop of ``c`` grpc.aio clients (each on a connection of
its own) keeps it busy. Four forms, each in a server process of its own:

- ``unary``: a unary-unary handler (ModelInfer as grpc.aio would serve it plainly);
- ``stream-unary``: the message read with ``context.read()`` from a request stream, as
  Stoker's ``limited`` takes every unary call (so the call counts before its message
  arrives and the message can be given a deadline);
- ``sync``: grpc's thread-pool server, unary;
- ``bidi``: one message and its answer at a time on a stream that stays open
  (ModelStreamInfer's shape).

    python scripts/grpc_floor.py --concurrency 8,32 --seconds 3 --rounds 2

Prints one line per form and load: messages/s (client-bound: one client process) and the
server's CPU per message in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
FORMS = ("unary", "stream-unary", "sync", "bidi")
MESSAGE = b"x" * 200


def serve(form: str, port: int) -> None:
    import grpc

    if form == "sync":
        from concurrent import futures

        sync = grpc.server(futures.ThreadPoolExecutor(8))
        handler: Any = grpc.unary_unary_rpc_method_handler(lambda request, _: request)
        sync.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("s", {"M": handler}),))
        sync.add_insecure_port(f"127.0.0.1:{port}")
        sync.start()
        sync.wait_for_termination()
        return

    async def unary(request: bytes, _: object) -> bytes:
        return request

    async def stream_unary(_: object, context: Any) -> bytes:
        data: bytes = await context.read()
        return data

    async def bidi(requests: object, _: object) -> object:
        async for request in requests:  # type: ignore[attr-defined]
            yield request

    handlers: dict[str, Any] = {
        "unary": grpc.unary_unary_rpc_method_handler(unary),
        "stream-unary": grpc.stream_unary_rpc_method_handler(stream_unary),
        "bidi": grpc.stream_stream_rpc_method_handler(bidi),
    }

    async def main() -> None:
        server = grpc.aio.server()
        method = "B" if form == "bidi" else "M"
        generic = grpc.method_handlers_generic_handler("s", {method: handlers[form]})
        server.add_generic_rpc_handlers((generic,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    import uvloop

    uvloop.install()
    asyncio.run(main())


async def load(port: int, form: str, concurrency: int, seconds: float) -> int:
    """Messages answered in ``seconds`` of a closed loop of ``concurrency`` clients."""
    import grpc

    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(concurrency)
    ]
    answered = 0

    async def client(channel: grpc.aio.Channel, until: float) -> None:
        nonlocal answered
        if form == "bidi":
            call: Any = channel.stream_stream("/s/B")()
            while time.monotonic() < until:
                await call.write(MESSAGE)
                await call.read()
                answered += 1
            await call.done_writing()
            return
        unary: Any = channel.unary_unary("/s/M")
        while time.monotonic() < until:
            await unary(MESSAGE)
            answered += 1

    until = time.monotonic() + seconds
    await asyncio.gather(*(client(channel, until) for channel in channels))
    for channel in channels:
        await channel.close()
    return answered


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", nargs=2, metavar=("FORM", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    from bench.launch import free_port

    servers = {}
    for form in FORMS:
        port = free_port()
        command = [sys.executable, __file__, "--serve", form, str(port)]
        servers[form] = (subprocess.Popen(command), port)
    try:
        time.sleep(3)
        for form, (_, port) in servers.items():
            asyncio.run(load(port, form, 2, 1.0))  # connections and the server warm
        for c in (int(v) for v in args.concurrency.split(",")):
            for form, (process, port) in servers.items():
                rates, costs = [], []
                for _ in range(args.rounds):
                    before = cpu_ticks(process.pid)
                    answered = asyncio.run(load(port, form, c, args.seconds))
                    used = cpu_ticks(process.pid) - before
                    rates.append(answered / args.seconds)
                    costs.append(used * 1e6 / TICK / max(answered, 1))
                print(
                    f"{form:>12} c={c:<3} {statistics.median(rates):8,.0f} messages/s  "
                    f"{statistics.median(costs):6,.0f} us of server CPU a message "
                    f"({', '.join(f'{v:,.0f}' for v in costs)})",
                    flush=True,
                )
    finally:
        for process, _ in servers.values():
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
