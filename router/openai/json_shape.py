"""Bounds on the shape of a decoded JSON body, checked before any field is read.

    nesting deeper than MAX_JSON_DEPTH       -> InvalidRequest naming the deepest path
    an integer outside [-2**63, 2**64 - 1]   -> InvalidRequest naming its path

Every later step (msgspec conversion, range checks, error messages, the msgpack
encoding of a node request) may then assume ints fit in 64 bits and recursion stays
shallow: an int of 5000 digits cannot even be formatted into a message, and msgpack
cannot encode one. The walk is iterative: a 10k-deep body cannot overflow it. A long list of ints (a
prompt as token ids) is checked by its min and max: 100k ids cost ~2 ms, not ~10.

Must not know the request's fields (openai/structs.py and prepare.py do).
"""

from __future__ import annotations

from typing import Any

from ...common.errors import InvalidRequest

MAX_JSON_DEPTH = 32  # OpenAI request bodies nest 4-6 levels; generous for extension fields
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1  # msgpack's range, and so the nodes'
MAX_KEY_SHOWN = 64  # characters of a key an error path shows
FAST_LIST = 64  # longer lists of numbers only (prompts as token ids) are checked in bulk
_NUMBERS = (int, float, bool)


def check_shape(obj: Any) -> None:
    """Raise `InvalidRequest` naming the path of the first container nested deeper than
    `MAX_JSON_DEPTH` or the first int outside 64 bits in ``obj`` (decoded JSON)."""
    # (container, its path, its depth); the path is built only for containers
    stack: list[tuple[Any, str, int]] = [(obj, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(path or "body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if type(node) is list and len(node) > FAST_LIST and _numbers_in_range(node):
            continue  # a token-id array: nothing nested, every int in range
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            t = type(value)
            if t is int:
                if not INT_MIN <= value <= INT_MAX:
                    raise InvalidRequest(_join(path, key), "integer out of range (it must fit "
                                         "in 64 bits)")
            elif t is dict or t is list:
                stack.append((value, _join(path, key), depth + 1))


def _numbers_in_range(items: list) -> bool:
    """True when ``items`` holds only numbers (no container) and none is an int out of
    range, found by min and max at C speed; False means "walk it item by item" (a
    container or a string makes min raise or return a non-number, an out-of-range int
    or a NaN fails the bounds)."""
    try:
        lo, hi = min(items), max(items)
    except TypeError:
        return False
    return (type(lo) in _NUMBERS and type(hi) in _NUMBERS
            and INT_MIN <= lo <= INT_MAX and INT_MIN <= hi <= INT_MAX)


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    key = key if len(key) <= MAX_KEY_SHOWN else key[:MAX_KEY_SHOWN] + "..."
    return f"{path}.{key}" if path else key
