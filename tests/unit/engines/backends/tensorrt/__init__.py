"""Tests of engines.backends.tensorrt."""
