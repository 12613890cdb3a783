"""Experiments on the KV transport: bandwidth per backend against a memory copy
(bench_kvtransfer). From GPU memory: ../gpu/bench_gpu_transfer.py."""
