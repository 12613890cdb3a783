"""What tests import and nothing ships: instruments for tests that build a cluster and break
it from outside.

    netns_lab.py     network namespaces, veth links and ``tc`` faults (tests/test_netns_faults.py)
    netns_shaper.py  a userspace netem over TUN devices, for kernels without sch_netem

Imported as ``splitserve.tests.kit`` (the checkout is the package). Code that ships
(``benchmarks/`` included) must not import it: the kit is not installed with splitserve.
"""
