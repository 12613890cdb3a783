"""The GPU suite and the GPU experiments it runs.

    suite.sh -> suite.py   every GPU figure in one command on a lent GPU machine (bundle.sh
                           packs what it carries, probe.py checks the machine, report.py
                           takes the files back into results/gpu/ and docs/gpu.md's table)
    contract.py            the JSON every GPU experiment writes, and the targets
    bench_kernels.py, bench_gpu_engine.py, bench_gpu_moe.py, bench_gpu_transfer.py,
    bench_gpu_serving.py
                           (with gpu_serving_report.py): the experiments, each also runnable
                           alone (``--smoke`` on the CPU)
"""
