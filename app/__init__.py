"""Stoker: the inference service (HTTP, protocol, batching, metrics, CLI)."""

__version__ = "0.1.0"
