"""check_shape's bulk path for long lists of numbers (prompts as token ids) finds
exactly what the item-by-item walk finds."""

import pytest

from splitserve.common.errors import InvalidRequest
from splitserve.router.openai.json_shape import FAST_LIST, MAX_JSON_DEPTH, check_shape

IDS = list(range(100, 100 + 4 * FAST_LIST))


@pytest.mark.parametrize("bad, path", [
    (IDS + [2**64] + IDS, "prompt[256]"),
    (IDS + [-(2**63) - 1], "prompt[256]"),
    (IDS + [float("nan"), 2**70], "prompt[257]"),
    ([[2**70]] * (2 * FAST_LIST), f"prompt[{2 * FAST_LIST - 1}][0]"),
    (IDS + ["x", 2**70], "prompt[257]"),
])
def test_out_of_range_ints_are_found_in_long_lists(bad, path):
    with pytest.raises(InvalidRequest) as e:
        check_shape({"prompt": bad})
    assert e.value.field == path


def test_long_lists_of_numbers_pass_and_nesting_is_still_bounded():
    check_shape({"prompt": IDS + [0, 2**64 - 1, -(2**63), 1.5, True]})
    check_shape({"prompt": IDS + [IDS]})  # nested, in range: fine here (types are checked later)
    deep = inner = list(IDS)
    for _ in range(MAX_JSON_DEPTH + 2):
        inner.append(list(IDS))
        inner = inner[-1]
    with pytest.raises(InvalidRequest, match="nested deeper"):
        check_shape({"prompt": deep})
