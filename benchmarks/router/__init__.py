"""Experiments on the router: routing policies on replayed traces (bench_routing), the
cost of a decision and replicas' agreement (bench_router_cost), the policy alone
(bench_policy_cost), and long prompts against the event loop (bench_router_loop)."""
