"""Reading a Prometheus exposition (a /metrics scrape) in tests."""

from prometheus_client.parser import text_string_to_metric_families


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` (as scraped, e.g. ``..._total``) in the
    exposition ``text`` whose labels include ``labels``: a metric read over its other
    labels (model_name, role, ...)."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def node_metric(cluster, name: str, metric_name: str, **labels: str) -> float:
    """``sample_sum`` of node ``name``'s /metrics in a running ``deploy.launcher.Cluster``."""
    import urllib.request

    with urllib.request.urlopen(f"{cluster.node(name).addr}/metrics", timeout=10) as r:
        return sample_sum(r.read().decode(), metric_name, **labels)
