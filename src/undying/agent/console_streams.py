"""Which of a worker's output streams reach the ``undying run`` console: torchrun's ``--redirects``,
``--tee`` and ``--local-ranks-filter``, with torchrun's values and meanings.

Parsed in the ``undying run`` process (the CLI) and applied in each node agent, which relays
the chosen streams of its workers' logs to the console (``output_relay.py``). The per-rank log
files always hold everything; these flags only choose what is also shown:

- ``--redirects V``: the streams that go to the log file *only* (not to the console);
- ``--tee V``: the streams shown on the console as well as logged, whatever ``--redirects`` says;
- ``--local-ranks-filter 0,1``: only these local ranks' output reaches the console.

``V`` is ``0`` (none), ``1`` (stdout), ``2`` (stderr), ``3`` (both), or a map of local ranks to
those values, ``0:1,1:2`` (a local rank the map does not name: ``0``). So a stream of local rank
``r`` is shown when ``r`` passes the filter and the stream is tee'd or not redirected, as torchrun's
tail of a tee'd or inherited stream does; by default every stream of every rank is shown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NONE, STDOUT, STDERR, BOTH = 0, 1, 2, 3
STREAM_NAMES = {STDOUT: "stdout", STDERR: "stderr"}
_VALUE = re.compile(r"[0-3]")
_MAP = re.compile(r"\d+:[0-3](,\d+:[0-3])*")
ALLOWED_STREAMS = "0 (none), 1 (stdout), 2 (stderr), 3 (both), or LOCAL_RANK:VALUE,... (e.g. 0:1,1:2)"


class StreamOptionError(ValueError):
    """A bad ``--redirects``, ``--tee`` or ``--local-ranks-filter``: one line naming the flag."""


@dataclass(frozen=True)
class ConsoleStreams:
    """The console streams of each local rank, as a bit set (``STDOUT | STDERR``) per local rank."""

    by_local_rank: tuple[int, ...]

    @classmethod
    def everything(cls, nproc_per_node: int) -> ConsoleStreams:
        return cls((BOTH,) * nproc_per_node)

    def of(self, local_rank: int) -> int:
        """The streams of ``local_rank`` shown on the console (a rank beyond the node's count: none)."""
        return self.by_local_rank[local_rank] if 0 <= local_rank < len(self.by_local_rank) else NONE

    def to_text(self) -> str:
        """For the agent's command line: ``3,3,0,1`` (local rank 0 first)."""
        return ",".join(str(streams) for streams in self.by_local_rank)

    @classmethod
    def from_text(cls, text: str) -> ConsoleStreams:
        return cls(tuple(int(part) for part in text.split(",") if part))


def parse_stream_choice(flag: str, text: str, nproc_per_node: int) -> tuple[int, ...]:
    """``--redirects``/``--tee``'s value as streams per local rank (``to_map`` in torchrun's terms)."""
    text = text.strip()
    if _VALUE.fullmatch(text):
        return (int(text),) * nproc_per_node
    if not _MAP.fullmatch(text):
        raise StreamOptionError(f"{flag}: allowed {ALLOWED_STREAMS} (got {text!r})")
    by_rank: dict[int, int] = {}
    for item in text.split(","):
        local_rank, value = (int(part) for part in item.split(":"))
        if local_rank >= nproc_per_node:
            raise StreamOptionError(f"{flag}: local rank {local_rank} out of range; allowed 0..{nproc_per_node - 1} "
                                    f"(--nproc-per-node {nproc_per_node}) (got {text!r})")
        by_rank[local_rank] = value
    return tuple(by_rank.get(local_rank, NONE) for local_rank in range(nproc_per_node))


def parse_ranks_filter(text: str, nproc_per_node: int) -> frozenset[int]:
    """``--local-ranks-filter 0,1``: the local ranks whose output reaches the console."""
    try:
        ranks = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise StreamOptionError(f"--local-ranks-filter: allowed a comma-separated list of local ranks, e.g. 0,1 "
                                f"(got {text!r})") from None
    outside = sorted(rank for rank in ranks if not 0 <= rank < nproc_per_node)
    if outside:
        raise StreamOptionError(f"--local-ranks-filter: local rank {outside[0]} out of range; allowed "
                                f"0..{nproc_per_node - 1} (--nproc-per-node {nproc_per_node}) (got {text!r})")
    return ranks


def console_streams(nproc_per_node: int, redirects: str | None = None, tee: str | None = None,
                    local_ranks_filter: str | None = None) -> ConsoleStreams:
    """What each local rank shows, from the three flags' texts (None: the flag was not given)."""
    redirected = parse_stream_choice("--redirects", redirects, nproc_per_node) if redirects else \
        (NONE,) * nproc_per_node
    teed = parse_stream_choice("--tee", tee, nproc_per_node) if tee else (NONE,) * nproc_per_node
    shown_ranks = parse_ranks_filter(local_ranks_filter, nproc_per_node) if local_ranks_filter else None
    return ConsoleStreams(tuple(
        ((BOTH & ~redirected[local_rank]) | teed[local_rank])
        if shown_ranks is None or local_rank in shown_ranks else NONE
        for local_rank in range(nproc_per_node)))
