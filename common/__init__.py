"""Shared by every process: frozen configs, wire types, block hashing, errors. Never imports torch."""
