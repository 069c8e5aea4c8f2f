"""Tests of engines.backends.torch."""
