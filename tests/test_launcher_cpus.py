"""The launcher's CPU pinning: each role's processes run on its CPUs only, with one
torch thread per CPU, and the cluster still serves."""

import os

import openai
import pytest

from splitserve.deploy.launcher import Cluster, parse_cpus

os.environ.setdefault("SPLITSERVE_QUIET", "1")
TWO_CPUS = {0, 1} <= os.sched_getaffinity(0)


def test_parse_cpus():
    assert parse_cpus(["prefill=0", "decode=1", "router=0,1"]) == {
        "prefill": (0,), "decode": (1,), "router": (0, 1)}
    assert parse_cpus([]) == {}
    for bad, match in (("gpu=0", "ROLE=CPU"), ("prefill=x", "ROLE=CPU"), ("decode=", "ROLE=CPU"),
                       ("decode=4095", "not available")):
        with pytest.raises(ValueError, match=match):
            parse_cpus([bad])


@pytest.mark.skipif(not TWO_CPUS, reason="needs CPUs 0 and 1")
def test_pinned_cluster_runs_each_role_on_its_cpus():
    cpus = {"prefill": [0], "decode": [1], "router": [0]}
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="shm", kv_cache_memory="64MiB",
                 threads_per_node=2, cpus=cpus) as c:
        for p in c.procs:
            role = p.name.split("-")[0]
            assert os.sched_getaffinity(p.popen.pid) == set(cpus[role]), p.name
            args = open(f"/proc/{p.popen.pid}/cmdline").read().split("\0")
            if role != "router":  # one torch thread per pinned CPU, not threads_per_node
                assert args[args.index("--threads") + 1] == "1"
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The sky is", max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
