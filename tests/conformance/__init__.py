"""Suites every implementation of an interface passes, run against each implementation."""
