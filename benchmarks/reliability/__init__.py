"""Experiments on what a cluster survives: kills and disconnects (bench_faults), a long
steady run against a fresh control (bench_soak, with soak_control.py), and fuzzed
requests and slowloris against the router (bench_router_abuse, with openai_fuzz.py)."""
