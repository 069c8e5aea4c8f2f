"""Stoker: the inference service, in two rooms: ``app.frontend`` (HTTP and gRPC, the data
plane, the remote engine client) and ``app.engine`` (the engine process, registry, batchers,
runner pools). The modules at this level are the floor both rooms stand on (the wire and its
channel, contract, protocol, errors, settings, metrics, tracing...), which imports neither
room, and the top that starts them, which neither imports: ``cli``, ``processes`` (the
supervisor) and ``control`` (``tests/unit/app/test_rooms.py`` holds them to it)."""

__version__ = "0.1.0"
