"""Attention backends behind one interface: the torch reference, CUDA kernels (csrc/) and
Triton kernels; ``selector.py`` picks one per engine."""
