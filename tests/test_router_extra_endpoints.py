"""vLLM's extra endpoints on the real router (real Redis, no nodes, the bundled
tokenizer) through HTTP: /tokenize (prompt and chat, vLLM's response shape, ids equal
to what generation uses), /detokenize round trips, /version, /ping; every bad field a
400 naming it, an unknown model a 404."""

import json

import pytest

import splitserve
from splitserve.router.app import start_router
from splitserve.router.config import RouterConfig
from splitserve.router.tokenizer import RouterTokenizer

pytestmark = pytest.mark.anyio
CONTEXT = 8192  # the bundled model's context
NAMES = ("SmolLM2-135M-Instruct", "alias")


@pytest.fixture(scope="module")
async def router(redis_url):
    running = await start_router(RouterConfig(host="127.0.0.1", port=0, redis_url=redis_url,
                                              served_model_names=NAMES))
    yield running.url
    await running.stop()


@pytest.fixture(scope="module")
def tok(bundled_dir):
    return RouterTokenizer(bundled_dir)


async def call(http, method: str, url: str, body=None) -> tuple[int, dict | None]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    async with http.request(method, url, data=data, headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        return r.status, json.loads(text) if text else None


async def test_tokenize_prompt_matches_tokenizer(router, http, tok, tokenizer):
    text = "Hello, world! naïve café"
    status, body = await call(http, "POST", f"{router}/tokenize", {"model": "alias", "prompt": text})
    assert status == 200
    assert body == {"count": len(body["tokens"]), "max_model_len": CONTEXT,
                    "tokens": tokenizer(text)["input_ids"], "token_strs": None}
    status, body = await call(http, "POST", f"{router}/tokenize",
                              {"prompt": text, "return_token_strs": True, "add_special_tokens": False})
    assert status == 200 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


async def test_tokenize_chat_uses_the_template(router, http, tok):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    status, body = await call(http, "POST", f"{router}/tokenize", {"messages": messages})
    assert status == 200 and body["tokens"] == tok.render_chat(messages)
    status, bare = await call(http, "POST", f"{router}/tokenize",
                              {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and bare["count"] < body["count"]
    assert body["tokens"][:bare["count"]] == bare["tokens"]  # only the reply header differs


async def test_detokenize_round_trips(router, http, tok):
    text = "A robot learns to paint 🎨."
    status, body = await call(http, "POST", f"{router}/detokenize", {"tokens": tok.encode(text)})
    assert status == 200 and body == {"prompt": text}


async def test_version_and_ping(router, http):
    assert await call(http, "GET", f"{router}/version") == (200, {"version": splitserve.__version__})
    for method in ("GET", "POST"):  # no decode node registered: not ready
        assert await call(http, method, f"{router}/ping") == (503, None)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, -5]}, "tokens[1]"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens[0]"),
])
async def test_bad_fields_are_400_naming_them(router, http, path, body, param):
    status, err = await call(http, "POST", router + path, body)
    assert status == 400, err
    assert err["error"]["param"] == param and param in err["error"]["message"]


@pytest.mark.parametrize("path,body", [("/tokenize", {"model": "other", "prompt": "x"}),
                                       ("/detokenize", {"model": "other", "tokens": [1]})])
async def test_unknown_model_is_404(router, http, path, body):
    status, err = await call(http, "POST", router + path, body)
    assert status == 404 and err["error"]["code"] == "model_not_found"


async def test_not_json_is_400(router, http):
    status, err = await call(http, "POST", f"{router}/tokenize", b"{nope")
    assert status == 400 and "JSON" in err["error"]["message"]


def test_api_key_guards_tokenize_but_not_ping():
    from splitserve.router.http.auth import needs_api_key
    keyed = RouterConfig(api_keys=("sekret-key-1234567890",))
    assert [needs_api_key(keyed, p) for p in ("/tokenize", "/detokenize", "/version", "/ping")] == [
        True, True, True, False]  # /ping is a probe, open like /health
    assert needs_api_key(RouterConfig(api_keys=keyed.api_keys, protect_health=True), "/ping")
    assert not needs_api_key(RouterConfig(), "/tokenize")
