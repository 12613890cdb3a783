"""A model folder served by real processes (redis-server, the router, one prefill and one
decode node) and checked token for token: the shared body of the model-family tests."""

from collections.abc import Callable

import openai

from splitserve.common import metric_names as names
from splitserve.deploy.launcher import Cluster
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.tests.metrics_text import node_metric


def assert_serves_greedy(path, prompts: list[list[int]], refs: list[list[int]], max_tokens: int,
                         more: Callable[[Cluster], None] | None = None, **cluster) -> None:
    """Each prompt's greedy completion through router -> prefill -> decode has the tokens of
    ``refs`` (as logprob tokens) and their count; its KV travelled from the prefill node (blocks
    sent, no fallback prefill on the decode node); then ``more(cluster)``, before it stops.
    ``cluster``: more arguments of the ``Cluster`` (kv_backend, policy, ...)."""
    tok = RouterTokenizer(path)
    c = Cluster(prefill_nodes=1, decode_nodes=1, kv_cache_memory="8MiB", model=str(path), **cluster)
    try:
        c.start()
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, ref in zip(prompts, refs):
            r = client.completions.create(model=str(path), prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          logprobs=0)
            assert r.choices[0].logprobs.tokens == [tok.token_text(t) for t in ref]
            assert r.usage.completion_tokens == len(ref)
        assert node_metric(c, "prefill-0", names.KV_BLOCKS_SENT) > 0
        assert node_metric(c, "decode-0", names.FALLBACK_PREFILLS) == 0
        if more is not None:
            more(c)
    except BaseException:
        for p in c.procs:
            print(f"--- {p.name} ---\n" + "\n".join(p.log[-40:]))
        raise
    finally:
        c.stop()
