"""Tests of zoo."""
