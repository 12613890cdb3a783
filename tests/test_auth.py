"""common/auth.py: where the cluster token comes from, the constant-time check, and
redacting Redis passwords from URLs."""

import pytest

from splitserve.common.auth import (ENV, HEADER, auth_headers, load_cluster_token, new_cluster_token,
                                    redact_url, token_ok)


def test_token_sources_in_order(tmp_path):
    f = tmp_path / "token"
    f.write_text("file-token-0123456789\n")
    env = {ENV: "env-token-0123456789"}
    assert load_cluster_token("flag-token-0123456789", str(f), env) == "flag-token-0123456789"
    assert load_cluster_token(None, str(f), env) == "file-token-0123456789"
    assert load_cluster_token(None, None, env) == "env-token-0123456789"
    assert load_cluster_token(None, None, {}) is None


def test_bad_tokens_name_their_source(tmp_path):
    with pytest.raises(ValueError, match="--cluster-token:.*16 characters"):
        load_cluster_token("short")
    with pytest.raises(ValueError, match=ENV):
        load_cluster_token(None, None, {ENV: "has space in the middle"})
    with pytest.raises(ValueError, match="--cluster-token-file: cannot read"):
        load_cluster_token(None, str(tmp_path / "missing"))


def test_check_and_headers():
    token = new_cluster_token()
    assert len(token) >= 40 and token != new_cluster_token()
    assert token_ok(token, token) and not token_ok(token, token[:-1] + "x") and not token_ok(token, None)
    assert token_ok(None, None) and token_ok(None, "anything")  # no token configured: open
    assert auth_headers(token) == {HEADER: token} and auth_headers(None) == {}


def test_redact_url():
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("rediss://app:s3cret@cache:6380/1") == "rediss://app:***@cache:6380/1"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
