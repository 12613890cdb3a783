"""The planner: sizes the prefill and decode pools from the SLO and the load.

    slo.py        Slo: TTFT and ITL bounds met by a share of requests; its flags
    perf.py       PoolModel: nodes each pool needs for a load, from a simulated-node profile
    predictor.py  moving average and Holt's trend, their errors, the better one answering
    observe.py    the routers' /metrics and the node registry -> one Observation per interval
    scaling.py    observation -> prediction -> correction -> targets -> change (bounds,
                  cooldowns, the hysteresis band), written down as a PlanningDecision
    actuator.py   LocalPools (start and drain `up`'s nodes) | ExportOnly (Kubernetes: the
                  HPAs follow the exported targets)
    service.py    the loop, /metrics and /debug/planner; `splitserve planner`, `up --planner`
    config.py     PlannerConfig and the flags

    offline/      `splitserve plan`: the cheapest fleet for a workload, searched on a model
                  of the fleet (fleetsim.py, search.py, workload.py, report.py, cli.py),
                  and the online policy in a closed loop with that model (loop.py)
"""
