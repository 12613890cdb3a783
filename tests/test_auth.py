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


def test_secret_flags_warn_and_files_readable_by_others_warn(tmp_path, monkeypatch, caplog):
    """A secret on the command line still works but says it is visible in `ps`; a secret
    file others may read says how to close it; the Redis URL comes from the flag, else
    $SPLITSERVE_REDIS_URL, and only a URL with a password on the flag is warned about."""
    from splitserve.common.auth import REDIS_URL_ENV, redis_url_from
    caplog.set_level("WARNING")
    assert _token(["--cluster-token", "flag-token-0123456789"]) == "flag-token-0123456789"
    assert "--cluster-token on the command line is visible" in caplog.text
    caplog.clear()
    f = tmp_path / "token"
    f.write_text("file-token-0123456789\n")
    f.chmod(0o644)
    assert _token(["--cluster-token-file", str(f)]) == "file-token-0123456789"
    assert "may be read by other users" in caplog.text and "chmod 600" in caplog.text
    caplog.clear()
    f.chmod(0o600)
    assert _token(["--cluster-token-file", str(f)]) == "file-token-0123456789" and not caplog.text
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:env-pw@10.0.0.1:6379/0")
    assert redis_url_from(None, "redis://default") == "redis://:env-pw@10.0.0.1:6379/0" and not caplog.text
    assert redis_url_from("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0" and not caplog.text
    assert redis_url_from("redis://:flag-pw@127.0.0.1:1/0") == "redis://:flag-pw@127.0.0.1:1/0"
    assert "--redis-url with a password" in caplog.text and "flag-pw" not in caplog.text
    monkeypatch.delenv(REDIS_URL_ENV)
    assert redis_url_from(None) is None and redis_url_from(None, "redis://d") == "redis://d"


def _keys(argv: list[str]):
    from splitserve.router.api_keys import api_keys_from_args
    p = argparse.ArgumentParser()
    p.add_argument("--api-key", action="append")
    p.add_argument("--api-key-file")
    return api_keys_from_args(p.parse_args(argv))


def test_api_key_specs_carry_cache_salts_from_flags_files_and_env(tmp_path, monkeypatch):
    from splitserve.router.api_keys import API_KEY_ENV, ApiKey, parse_key_spec
    a, b = "key-a-0123456789", "key-b-0123456789"
    f = tmp_path / "keys"
    f.write_text(f"# tenants\n{a} cache_salt=tenant-a\n\n  {b}\n")
    f.chmod(0o600)
    assert _keys(["--api-key-file", str(f)]) == (ApiKey(a, "tenant-a"), ApiKey(b))
    assert _keys(["--api-key", f"{a} cache_salt=x", "--api-key", b]) == (ApiKey(a, "x"), ApiKey(b))
    monkeypatch.setenv(API_KEY_ENV, f"{a} cache_salt=s-a\n {b}\n")  # one spec per line
    assert _keys([]) == (ApiKey(a, "s-a"), ApiKey(b))
    assert _keys(["--api-key", b]) == (ApiKey(b),)  # flags and files win over the environment
    monkeypatch.delenv(API_KEY_ENV)
    assert _keys([]) == ()
    assert all(parse_key_spec(k.spec(), "x") == k for k in (ApiKey(a), ApiKey(a, "t")))
    for spec, match in ((f"{a} salt=x", "expected 'KEY' or 'KEY cache_salt=SALT'"),
                        (f"{a} cache_salt=", "expected"), (f"{a} {b}", "a key has no whitespace"),
                        (f"{a} cache_salt=x cache_salt=y", "expected"), ("short cache_salt=x", "api key")):
        with pytest.raises(ValueError, match=match):
            parse_key_spec(spec, "--api-key")
    with pytest.raises(ValueError, match="different cache salts"):
        _keys(["--api-key", f"{a} cache_salt=x", "--api-key", f"{a} cache_salt=y"])
    f.write_text(f"{a}\n{a} bad\n")
    with pytest.raises(ValueError, match=f"{f}:2"):  # names the line at fault
        _keys(["--api-key-file", str(f)])


def test_effective_cache_salt_keeps_tenants_apart():
    """The key's salt and the request's never mix: whatever a request sends as cache_salt,
    its effective salt differs from that of every request of another key's salt."""
    from splitserve.router.api_keys import ApiKey, effective_cache_salt, matched_key
    assert effective_cache_salt(None, None) is None
    tenant_a = {effective_cache_salt("A", r) for r in (None, "x", "A", '["A",null]')}
    tenant_b = {effective_cache_salt("B", r) for r in (None, "x", "A", '["A",null]')}
    unsalted_key = {effective_cache_salt(None, r) for r in ("A", "x", '["A",null]', '["A","x"]', "B")}
    assert len(tenant_a) == 4 and not tenant_a & tenant_b and not tenant_a & unsalted_key
    assert not tenant_b & unsalted_key
    assert effective_cache_salt("A", None) == effective_cache_salt("A", None)  # one tenant: one cache
    keys = (ApiKey("key-a-0123456789", "A"), ApiKey("key-b-0123456789"))
    assert matched_key(keys, "key-a-0123456789") == keys[0] and matched_key(keys, "key-b-0123456789") == keys[1]
    assert matched_key(keys, "key-c-0123456789") is None and matched_key(keys, None) is None


def test_config_reprs_hold_no_redis_password():
    """A node's and the planner's frozen configs carry the Redis URL, password included;
    their repr (what a log line or a traceback prints) holds neither the URL nor the password."""
    from splitserve.common.config import EngineConfig, NodeConfig
    from splitserve.deploy.planner.config import PlannerConfig
    from splitserve.deploy.planner.slo import Slo
    url = "redis://:pw-0123456789abcdef@10.0.0.1:6379/0"
    node = NodeConfig(role="decode", engine=EngineConfig(), redis_url=url)
    planner = PlannerConfig(profile="smollm2-135m-cpu", slo=Slo(ttft_s=1.0, itl_s=0.1), redis_url=url)
    for config in (node, planner):
        assert config.redis_url == url
        assert "pw-0123456789abcdef" not in repr(config) and "10.0.0.1" not in repr(config)


def test_a_comma_in_the_api_key_variable_is_refused_never_split(monkeypatch):
    """$SPLITSERVE_API_KEY holds one key spec per line: a comma is refused with a message
    saying so (split on it, a key containing one became two keys, each half
    authenticating alone); the message holds no key material. Files and flags keep a
    comma inside a key: nothing splits there."""
    from splitserve.router.api_keys import API_KEY_ENV, ApiKey
    a, b = "key-a-0123456789", "key-b-0123456789"
    for value in (f"{a},{b}", f"{a} cache_salt=x, {b}", f"{a},"):
        monkeypatch.setenv(API_KEY_ENV, value)
        with pytest.raises(ValueError, match=r"\$SPLITSERVE_API_KEY: .*comma.*one key spec per line") as e:
            _keys([])
        assert "0123456789" not in str(e.value)
    assert _keys(["--api-key", f"{a},{b}"]) == (ApiKey(f"{a},{b}"),)


def test_key_spec_errors_hold_no_key_material(tmp_path):
    """Whatever is wrong with a key spec, the error names where it came from and what to
    write, never a part of the spec (a key with a space in it reads as a key and an option)."""
    from splitserve.router.api_keys import parse_key_spec
    secret = "SeCrEt"
    for spec in (f"key-{secret}-part one{secret}two", f"key-{secret}-part {secret}=x",
                 f"key-{secret}-0123 cache_salt=a cache_salt={secret}", f"key-{secret}-0123 cache_salt=",
                 f"key-{secret}-0123 cache_salt={secret}," + "s" * 300, f"#{secret}-0123456789",
                 f"{secret} cache_salt=x"):
        with pytest.raises(ValueError) as e:
            parse_key_spec(spec, "keys.txt:3")
        assert str(e.value).startswith("keys.txt:3: ") and secret not in str(e.value), str(e.value)


def test_an_api_key_file_without_a_key_is_refused(tmp_path, monkeypatch):
    """A key file holding only comments and blank lines is an error, not 'no keys' (which
    would leave the router open to anyone)."""
    from splitserve.router.api_keys import API_KEY_ENV
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    f = tmp_path / "keys"
    f.write_text("# nobody yet\n\n")
    f.chmod(0o600)
    with pytest.raises(ValueError, match="holds no key"):
        _keys(["--api-key-file", str(f)])


def test_keys_without_a_salt_each_get_their_own_derived_from_the_key():
    """With API keys, a key without a cache salt gets one of its own: an HMAC of the key
    under a secret derived from the cluster token (router replicas agree; the salt, which
    nodes and logs see, neither holds nor confirms the key). Keys naming the same salt
    share it; --shared-prefix-cache gives keys without a salt the one unsalted cache."""
    import argparse
    import hashlib

    from splitserve.router.api_keys import ApiKey, derived_salt
    from splitserve.router.config import RouterConfig, add_router_args, router_config
    a, b, c, d = (f"key-{n}-0123456789" for n in "abcd")
    keys = (ApiKey(a), ApiKey(b), ApiKey(c, "team"), ApiKey(d, "team"))
    salts = [k.cache_salt for k in RouterConfig(api_keys=keys, cluster_token="token-0123456789").api_keys]
    assert salts[2:] == ["team", "team"]  # explicit: shared by choice
    assert None not in salts[:2] and salts[0] != salts[1]  # derived: one cache per key
    assert salts[0] == derived_salt("token-0123456789", a)  # every replica derives the same
    for key, salt in zip((a, b), salts):
        assert key not in salt and "0123456789" not in salt
        assert hashlib.sha256(key.encode()).hexdigest()[:16] not in salt  # not a plain hash either
    assert derived_salt("other-token-0123", a) != salts[0] and derived_salt(None, a) != salts[0]
    again = RouterConfig(api_keys=RouterConfig(api_keys=keys, cluster_token="token-0123456789").api_keys,
                         cluster_token="token-0123456789")
    assert [k.cache_salt for k in again.api_keys] == salts  # resolving twice changes nothing
    p = argparse.ArgumentParser()
    add_router_args(p)
    shared = router_config(p.parse_args(["--api-key", a, "--api-key", f"{c} cache_salt=team",
                                         "--shared-prefix-cache"]))
    assert shared.shared_prefix_cache and [k.cache_salt for k in shared.api_keys] == [None, "team"]
    assert RouterConfig().api_keys == ()  # no keys: nothing to salt
