"""The GPU suite's three lists, each a text file beside this one, read here only:
carried.txt (what bundle.sh carries), image_packages.txt (what the lent image holds) and
gpu_tests.txt (the gpu tests stage 1 runs). In each, ``#`` starts a comment."""

import re
from pathlib import Path

HERE = Path(__file__).parent


def _rows(name: str) -> list[list[str]]:
    lines = (line.split("#", 1)[0].split() for line in (HERE / name).read_text().splitlines())
    return [row for row in lines if row]


def normalize(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def carried() -> list[tuple[str, str]]:
    """(distribution, module) of each package bundle.sh carries as a wheel."""
    return [(row[0], row[1]) for row in _rows("carried.txt")]


def image_packages() -> set[str]:
    """The normalized names of the lent image's Python packages."""
    return {normalize(row[0]) for row in _rows("image_packages.txt")}


def gpu_test_ids() -> list[str]:
    """The pytest node ids stage 1 runs."""
    return [row[0] for row in _rows("gpu_tests.txt")]
