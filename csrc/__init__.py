"""CUDA kernels and their bindings: paged decode attention (split-K), the KV cache write,
block pack/unpack (issue 6). ``build.py`` compiles them on first use on a GPU machine,
``ops.py`` checks arguments and calls them. Never required on a CPU-only machine:
nothing here builds or loads on import."""
