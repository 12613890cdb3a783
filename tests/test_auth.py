"""common/auth.py: where the cluster token comes from, the constant-time check, the
headers of internal requests, and redacting Redis passwords from URLs."""

import argparse

import pytest

from splitserve.common.auth import (CLUSTER_TOKEN_ENV, CLUSTER_TOKEN_HEADER, add_cluster_token_args,
                                    auth_headers, cluster_token_from_args, new_cluster_token, redact_url,
                                    token_matches)


def _token(argv: list[str]) -> str | None:
    p = argparse.ArgumentParser()
    add_cluster_token_args(p)
    return cluster_token_from_args(p.parse_args(argv))


def test_token_sources_in_order(tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_text("file-token-0123456789\n")
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "env-token-0123456789")
    assert _token(["--cluster-token", "flag-token-0123456789", "--cluster-token-file", str(f)]) == \
        "flag-token-0123456789"
    assert _token(["--cluster-token-file", str(f)]) == "file-token-0123456789"
    assert _token([]) == "env-token-0123456789"
    monkeypatch.delenv(CLUSTER_TOKEN_ENV)
    assert _token([]) is None


def test_bad_tokens_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="cluster token: must be at least"):
        _token(["--cluster-token", "short"])
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "has space in the middle")
    with pytest.raises(ValueError, match="without whitespace"):
        _token([])
    with pytest.raises(ValueError, match="cannot read"):
        _token(["--cluster-token-file", str(tmp_path / "missing")])


def test_check_and_headers():
    token = new_cluster_token()
    assert len(token) >= 40 and token != new_cluster_token()
    assert token_matches(token, token) and not token_matches(token[:-1] + "x", token)
    assert not token_matches(None, token)
    assert auth_headers(token) == {CLUSTER_TOKEN_HEADER: token} and auth_headers(None) == {}


def test_redact_url():
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("rediss://app:s3cret@cache:6380/1") == "rediss://app:***@cache:6380/1"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
