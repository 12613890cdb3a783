"""The offline planner, ``splitserve plan``: the cheapest prefill/decode fleet for one
workload and an SLO, searched on an event-driven model of the fleet (the online planner
beside it sizes the pools of a running cluster).

    workload.py   phases of Poisson arrivals, the named presets -> a trace
    fleetsim.py   the fleet model: a trace on P prefill and D decode nodes -> TTFT, ITL
    search.py     the cheapest (P, D) and TP per pool meeting the SLO (../perf.py starts it)
    loop.py       the online planner's policy in a closed loop with the fleet model: a
                  policy tried on a trace in a second
    report.py     the table, the JSON and the plot
    cli.py        the flags; ``--check`` replays the plan on simulated nodes (a load tool the
                  top-level CLI hands in)
"""
