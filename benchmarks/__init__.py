"""Benchmarks and load tools shipped with splitserve (``splitserve replay``); the
scripts next to this file are run directly (see README.md)."""
