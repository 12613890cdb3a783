"""Property-based fuzz of the OpenAI endpoints (hypothesis, ~200 cases): a real
router process in front of a real simulated decode node (the real server, block
pool and scheduler; a timing model for the forward pass) and a real Redis.

Every case (random JSON of random shapes, wrong types, ints beyond 64 bits, NaN
literals, deep nesting, raw bytes, compressed bodies, odd headers; see
benchmarks/reliability/openai_fuzz.py) must get an answer below 500, and afterwards the router
answers /health and the node process is alive. Also here, with the same cluster:
/debug/decisions answers only a caller with the cluster token, request ids included."""

import json
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings

from splitserve.benchmarks.reliability.openai_fuzz import FuzzCase, fuzz_cases, send
from splitserve.common.auth import CLUSTER_TOKEN_HEADER

pytestmark = pytest.mark.slow

TOKEN = "fuzz-cluster-token-0123456789"


@pytest.fixture(scope="module")
def cluster():
    """Redis, one simulated decode node and the router, every process given the cluster
    token through the environment (as `splitserve up` does)."""
    from splitserve.deploy.launcher import SimCluster

    # --max-model-len 128: every valid case generates few tokens
    with SimCluster(0, 1, fleet_procs=1, sim_args=["--sim-speedup", "50"], kv_cache_memory="256MiB",
                    router_args=["--max-model-len", "128"], cluster_token=TOKEN) as c:
        yield c


def get(url: str, headers=None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_fuzzed_requests_never_get_5xx(cluster):
    host, port = cluster.url.removeprefix("http://").split(":")
    statuses: dict[int, int] = {}

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(case=fuzz_cases())
    def check(case: FuzzCase):
        status = send(host, int(port), case)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (status, case.path, case.headers, case.body[:500])

    check()
    print("statuses:", statuses)
    assert sum(statuses.values()) >= 100
    assert statuses.get(200, 0) >= 5, statuses  # valid bodies were among the cases, and served
    assert len(statuses) >= 3, statuses  # and rejected ones
    assert get(cluster.url + "/health")[0] == 200
    assert all(p.popen.poll() is None for p in cluster.procs), "a process died"


def test_decisions_answer_only_the_cluster_token(cluster):
    host, port = cluster.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2})
    case = FuzzCase("/v1/completions", body.encode(), {"Content-Type": "application/json"})
    assert send(host, int(port), case) == 200
    for wrong in ({}, {CLUSTER_TOKEN_HEADER: TOKEN + "x"}):  # every client's traffic: the token's alone
        status, refused = get(cluster.url + "/debug/decisions?limit=5", wrong)
        assert status == 403 and "cluster token" in refused["error"]["message"]
    _, with_token = get(cluster.url + "/debug/decisions?limit=5", {CLUSTER_TOKEN_HEADER: TOKEN})
    ids = [d["request_id"] for d in with_token["decisions"]]
    assert ids and all(i.startswith(("cmpl-", "chatcmpl-")) for i in ids)
