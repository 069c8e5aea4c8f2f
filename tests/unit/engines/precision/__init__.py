"""Tests of engines.precision."""
