"""Experiments on whole clusters serving requests on the CPU: TTFT disaggregated against
colocated (bench_ttft), and TPOT and throughput against colocated and llama-cpp-python
(compare_serving, with its baselines.py and compare_report.py). On one GPU:
../gpu/bench_gpu_serving.py."""
