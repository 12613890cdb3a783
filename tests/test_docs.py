"""The manual's commands run: every fenced block of README.md and docs/*.md whose info string
marks it runnable, from the checkout root, must exit 0 (docs/README.md, "The pages' commands
run in CI", is the convention):

    ```bash runnable            bash -euo pipefail
    ```python runnable          this venv's python
    ```bash runnable cluster    (or python) against the README tour's cluster: one
                                `splitserve up` for the whole file, http://127.0.0.1:8000
                                rewritten to its URL

Every page has at least one runnable block (a page that lost them, or a misspelt marker,
fails here rather than going silently untested), a fence's words after the language are only
`runnable` and `cluster`, and every relative link and #anchor of the pages (and of
ARCHITECTURE.md and the benchmarks' READMEs) resolves.

"The checkout root" is a scratch folder holding a link to each top-level entry of the checkout
(`.venv` -> the venv running these tests), so `deploy/...` and `.venv/bin/...` resolve and
what a command writes stays out of the checkout.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from splitserve.deploy.local_redis import free_port

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # each needs a runnable block
LINKED = [*PAGES, ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "README.md",
          ROOT / "benchmarks" / "loadgen" / "README.md"]  # their links must resolve
TOUR_URL = "http://127.0.0.1:8000"  # the README tour's router, as the pages write it
MARKS = {"runnable", "cluster"}  # the words a fence may carry after its language
RUNS = {"bash": ["bash", "-euo", "pipefail", "-c"], "python": [sys.executable, "-c"]}
BLOCK_TIMEOUT_S = 120  # one block; the slowest (a short replay) takes ~15 s on two busy cores
UP_START_S = 180  # `up`'s own --startup-timeout
SECRETS = ("SPLITSERVE_API_KEY", "SPLITSERVE_CLUSTER_TOKEN", "SPLITSERVE_REDIS_URL",
           "SPLITSERVE_RESPONSES_REDIS_URL")  # never inherited: the tour's cluster makes its own
FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


class Block(NamedTuple):
    page: Path
    line: int  # the opening fence's, 1-based
    words: tuple[str, ...]  # the info string: language, then marks
    code: str

    @property
    def runnable(self) -> bool:
        return "runnable" in self.words[1:]

    @property
    def cluster(self) -> bool:
        return "cluster" in self.words[1:]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page (a fence closes on the same character, at least as
    long, with no info string)."""
    found: list[Block] = []
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(1), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].startswith(fence[0] * len(fence))
                                      and not lines[i].strip(fence[0]).strip()):
            body.append(lines[i])
            i += 1
        found.append(Block(page, start + 1, tuple(m.group(2).split()), "\n".join(body) + "\n"))
        i += 1
    return found


RUNNABLE = [b for page in PAGES for b in blocks(page) if b.runnable]


@pytest.fixture(scope="module")
def checkout_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checkout")
    for entry in ROOT.iterdir():
        if entry.name not in (".venv", ".git"):
            (root / entry.name).symlink_to(entry)
    (root / ".venv").symlink_to(Path(sys.prefix))
    return root


def block_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def tour_cluster(tmp_path_factory):
    """`splitserve up` as the README's tour starts it (the bundled model, one prefill and one
    decode node), on a free port; its URL once it serves. Ctrl-C after: it must exit 0."""
    log = tmp_path_factory.mktemp("tour") / "up.log"
    port = free_port()
    with log.open("w") as out:
        up = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--port", str(port)],
                              stdout=out, stderr=subprocess.STDOUT, env=block_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + UP_START_S
        while not (m := re.search(r"serving the OpenAI API at (http://\S+)/v1", log.read_text())):
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        yield m.group(1)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            code = up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            raise
    assert code == 0, log.read_text()[-4000:]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_a_runnable_block_exits_zero(block: Block, checkout_root, request):
    lang = block.words[0]
    assert lang in RUNS, f"{block.id}: runnable blocks are {sorted(RUNS)}, not {lang!r}"
    code = block.code
    if block.cluster:
        assert TOUR_URL in code, f"{block.id}: marked cluster but never names {TOUR_URL}"
        code = code.replace(TOUR_URL, request.getfixturevalue("tour_cluster"))
    try:
        out = subprocess.run([*RUNS[lang], code], cwd=checkout_root, env=block_env(), capture_output=True,
                             text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id}: still running after {BLOCK_TIMEOUT_S} s\n{code}\n{e.stdout}\n{e.stderr}")
    assert out.returncode == 0, (f"{block.id} exited {out.returncode}:\n{code}\n--- stdout\n{out.stdout[-4000:]}"
                                 f"\n--- stderr\n{out.stderr[-4000:]}")


def test_every_page_has_a_runnable_block():
    assert RUNNABLE, "no runnable block in README.md or docs/"
    assert len(PAGES) > 10, [p.name for p in PAGES]  # the manual is there
    bare = [p.relative_to(ROOT) for p in PAGES if not any(b.runnable for b in blocks(p))]
    assert not bare, f"pages without a runnable block (docs/README.md says how to mark one): {bare}"


def test_fences_carry_only_known_marks():
    for page in PAGES:
        for b in blocks(page):
            assert set(b.words[1:]) <= MARKS, f"{b.id}: {' '.join(b.words)!r}: marks are {sorted(MARKS)}"
            assert not b.cluster or b.runnable, f"{b.id}: 'cluster' without 'runnable'"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces -> -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The #anchors of a page's headings (a repeated heading's: -1, -2, ...)."""
    found: set[str] = set()
    repeats: dict[str, int] = {}  # slug -> times seen before
    in_block = {b.line + i for b in blocks(page) for i in range(b.code.count("\n") + 2)}
    for n, line in enumerate(page.read_text().split("\n"), 1):
        if n not in in_block and (m := re.match(r"^#{1,6} (.+)$", line)):
            s = slug(m.group(1))
            found.add(f"{s}-{repeats[s]}" if s in repeats else s)
            repeats[s] = repeats.get(s, 0) + 1
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link outside code."""
    in_block = {b.line + i for b in blocks(page) for i in range(b.code.count("\n") + 2)}
    found = []
    for n, line in enumerate(page.read_text().split("\n"), 1):
        if n in in_block:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        found += [(n, t) for t in re.findall(r"\]\(([^)\s]+)\)", prose)]
    return found


def test_relative_links_and_anchors_resolve():
    broken = []
    for page in LINKED:
        for n, target in links(page):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{n}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such heading in {dest.relative_to(ROOT)})")
    assert not broken, "\n".join(broken)
