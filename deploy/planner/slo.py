"""The service-level objective, one type for the planners (online and offline) and for
``splitserve bench --goodput``, and the planners' flags.

    Slo(ttft_s, itl_s, attainment): at least ``attainment`` of the requests get their
    first token within ``ttft_s`` and their later tokens ``itl_s`` apart on average

Units: seconds, in the type and everywhere it is computed with; milliseconds only where
people type or read them (the flags, ``describe``, bench's ``ttft_ms``/``tpot_ms`` keys).
A request's ITL here is its mean inter-token latency (decode time over output tokens - 1:
what ``splitserve bench`` reports as TPOT, so its ``--goodput tpot:MS`` is this bound);
``--itl-p90 50`` means 90% of the requests average 50 ms or less between tokens. A
one-token answer meets it. A bound not given is ``inf`` (bench may give one alone; the
planners' flags need both).

Owns the type and the parsing of ``--ttft-p90 / --itl-p90`` and of goodput terms
(``--goodput ttft:MS itl:MS``, ``tpot`` is read as ``itl``). Must not import anything
above common/.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = math.inf
    itl_s: float = math.inf
    attainment: float = 0.9  # share of requests that must meet each bound

    def __post_init__(self):
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError(f"SLO: TTFT and ITL bounds must be > 0, got {self.ttft_s} s and {self.itl_s} s")
        if not 0.5 <= self.attainment < 1:
            raise ValueError(f"SLO: attainment must be in [0.5, 1), got {self.attainment}")

    def describe(self) -> str:
        q = round(self.attainment * 100, 1)
        return f"TTFT p{q:g} <= {self.ttft_s * 1000:g} ms, ITL p{q:g} <= {self.itl_s * 1000:g} ms"


def add_slo_args(p: argparse.ArgumentParser, prefix: str = "",
                 defaults: tuple[float, float] | None = None) -> None:
    """``--ttft-p90 MS``, ``--itl-p90 MS``, ``--goodput ttft:MS itl:MS``, ``--attainment F``
    (``prefix`` names them apart where another command's flags share a parser);
    ``defaults``: (TTFT, ITL) milliseconds when the flags are not given (None: required)."""
    g = p.add_argument_group("SLO")
    ttft, itl = defaults or (None, None)
    g.add_argument(f"--{prefix}ttft-p90", type=float, default=ttft, metavar="MS",
                   help="90%% of requests get their first token within MS milliseconds"
                        + (f" (default {ttft:g})" if ttft else ""))
    g.add_argument(f"--{prefix}itl-p90", type=float, default=itl, metavar="MS",
                   help="90%% of requests average at most MS milliseconds between tokens"
                        + (f" (default {itl:g})" if itl else ""))
    g.add_argument(f"--{prefix}goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="the bounds as splitserve bench --goodput takes them: ttft:MS itl:MS (tpot: = itl:), "
                        "met by --attainment of the requests")
    g.add_argument(f"--{prefix}attainment", type=float, default=None,
                   help="share of requests that must meet both bounds (default 0.9; with --ttft-p90 / "
                        "--itl-p90 it is 0.9)")


def slo_from_args(args: argparse.Namespace, prefix: str = "") -> Slo:
    """The Slo the flags of ``add_slo_args`` give; ValueError naming the flag when one is
    missing or malformed."""
    key = prefix.replace("-", "_")
    ttft, itl = getattr(args, f"{key}ttft_p90"), getattr(args, f"{key}itl_p90")
    goodput, attainment = getattr(args, f"{key}goodput"), getattr(args, f"{key}attainment")
    if goodput:
        for term in goodput:
            name, _, value = term.partition(":")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--{prefix}goodput: {term!r}; use ttft:MS or itl:MS") from None
            if name == "ttft":
                ttft = ms
            elif name in ("itl", "tpot"):
                itl = ms
            else:
                raise ValueError(f"--{prefix}goodput: unknown term {name!r}; use ttft:MS and itl:MS")
    if ttft is None or itl is None:
        raise ValueError(f"SLO: give both bounds, --{prefix}ttft-p90 MS and --{prefix}itl-p90 MS "
                         f"(or --{prefix}goodput ttft:MS itl:MS)")
    return Slo(ttft / 1000, itl / 1000, 0.9 if attainment is None else attainment)
