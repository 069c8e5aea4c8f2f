"""Engines: turn a model file into a callable. Never imports the service."""
