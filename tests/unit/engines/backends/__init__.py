"""Tests of engines.backends."""
