"""Tests of engines.devices."""
