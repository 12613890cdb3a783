"""A node's ranks as processes, above the runners they build: where a rank runs
(placement.py), a worker rank's loop (worker.py), rank 0's launch of and link to its workers
(launch.py), a data-parallel rank's joining (data_parallel.py), and the engine's bring-up of
its runner with them (bringup.py). The collectives they run are engine/parallel/."""
