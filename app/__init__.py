"""Stoker: the inference service (HTTP, protocol, batching, metrics, CLI)."""
