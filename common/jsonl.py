"""Reading JSON-lines inputs (routing traces, custom bench datasets): one decoded row
per non-blank line, every error a ValueError naming the line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec


def read_jsonl(path: str | Path, type_: Any, what: str) -> Iterator[tuple[int, Any]]:
    """(line number, the line decoded as ``type_``) for each non-blank line of ``path``;
    ``what`` starts every error message (e.g. "trace")."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e}") from None
    decoder = msgspec.json.Decoder(type_)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = decoder.decode(line)
        except msgspec.ValidationError as e:
            raise ValueError(f"{what} line {number}: {e}") from None
        except msgspec.DecodeError as e:
            raise ValueError(f"{what} line {number}: not JSON: {e}") from None
        yield number, row
