"""The engine: the engine process and its control server, the model repository, loading and
registry, batchers, runner pools, handlers and image decoding."""
