"""CUDA kernels and their bindings (issue 6). Never required on a CPU-only machine."""
