"""Attention backends behind one interface: the torch reference (CPU) now, CUDA and Triton kernels later."""
