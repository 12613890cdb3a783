"""The transports a KV block can travel by, each behind kvtransfer/base.py's interface and
chosen in kvtransfer/factory.py: tcp, shm, ucx, nccl (with its pair group) and ipc."""
