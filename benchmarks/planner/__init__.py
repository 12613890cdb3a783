"""Experiments on the planner: whether ``splitserve plan``'s fleets meet the SLOs it
predicts when replayed (bench_plan), and whether the online planner holds the SLO through
a shift of the load for less than the cheapest static split (bench_online)."""
