"""The planner reads routers that protect /metrics (--protect-metrics) with the cluster
token, and a read that fails (401, a router down) is loud: a warning naming the router
and why, planner_scrape_failures_total by reason, and /debug/planner's routers state,
never a silent interval of zeros. A real router app, a real redis-server."""

import logging

import pytest

from splitserve.common import metric_names as names
from splitserve.deploy.launcher import free_port
from splitserve.deploy.planner.config import planner_config
from splitserve.deploy.planner.service import Planner
from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig
from splitserve.tests.metrics_text import sample_sum

pytestmark = pytest.mark.anyio

KEY = "client-key-0123456789"
TOKEN = "cluster-token-0123456789"


def planner_args(*extra: str):
    import argparse

    from splitserve.deploy.planner.config import add_planner_args
    p = argparse.ArgumentParser()
    add_planner_args(p)
    return p.parse_args(["--ttft-p90", "5000", "--itl-p90", "500", *extra])


@pytest.fixture(scope="module")
async def router(redis_url):
    running = await start_router(RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url, api_keys=(KEY,),
                                              cluster_token=TOKEN, protect_metrics=True))
    yield running.url
    await running.stop()


def failures(planner: Planner, reason: str) -> float:
    return sample_sum(planner.metrics.m.render()[0].decode(), names.PLANNER_SCRAPE_FAILURES, reason=reason)


async def test_the_planner_reads_protected_metrics_with_the_cluster_token(router, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    monkeypatch.delenv("SPLITSERVE_CLUSTER_TOKEN", raising=False)
    config = planner_config(planner_args("--router-url", router, "--cluster-token-file", str(token_file)))
    assert config.cluster_token == TOKEN
    planner = Planner(config)
    try:
        assert (await planner.observe()) is None  # the first scrape is the baseline
        assert planner.observer.last_scrape.answered == 1 and not planner.observer.last_scrape.failed
        assert failures(planner, "unauthorized") == 0
    finally:
        await planner.observer.close()


async def test_a_refused_or_failed_read_is_loud(router, caplog, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_CLUSTER_TOKEN", raising=False)
    down = f"http://127.0.0.1:{free_port()}"
    planner = Planner(planner_config(planner_args("--router-url", router, "--router-url", down)))
    try:
        with caplog.at_level(logging.WARNING, logger="splitserve.deploy.planner"):
            assert await planner.observe() is None
            assert await planner.observe() is None  # no router answered: no decision, said so
        scrape = planner.observer.last_scrape
        assert scrape.answered == 0 and len(scrape.failed) == 2
        text = " ".join(r.getMessage() for r in caplog.records)
        assert "401" in text and "cluster token" in text and down in text
        assert failures(planner, "unauthorized") == 2 and failures(planner, "unreachable") == 2
        debug = planner.debug()
        assert debug["routers"]["answered"] == 0 and len(debug["routers"]["failed"]) == 2
        assert sample_sum(planner.metrics.m.render()[0].decode(), names.PLANNER_ROUTERS_SCRAPED) == 0
    finally:
        await planner.observer.close()
