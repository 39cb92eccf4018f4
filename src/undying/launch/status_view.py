"""``undying status`` as a person reads it: the job in one table, redrawn in place with ``--watch``.

Runs in the user's shell (the CLI process). Draws the controller's ``/status`` (controller/status.py)
with rich: a header line (state, generation, world size, committed step, steps/s, the scalars of
``ft.log``, recoveries against max_restarts, the newest durable checkpoint), one row per rank (node,
host, PID, phase, step, loss, heartbeat age, generation) or, for a large job, one row per node, and
the latest faults and recoveries beneath.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

RANK_ROWS_UP_TO = 32  # more ranks than this: one row per node
RECENT_SHOWN = 8
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})
_PHASE_STYLE = {"computing": "green", "syncing": "green", "updating": "green", "updated": "green",
                "starting": "yellow", "recovering": "bold yellow", "done": "blue"}


def render_status(status: dict[str, Any], now: float | None = None) -> RenderableType:
    """The whole view of one ``/status`` answer (``now``: wall time, for the ages of the latest events)."""
    now = time.time() if now is None else now
    parts: list[RenderableType] = [_header(status)]
    ranks = status.get("ranks", {})
    parts.append(_rank_table(status) if len(ranks) <= RANK_ROWS_UP_TO else _node_table(status))
    recent = status.get("recent") or []
    if recent:
        lines = Text("latest faults and recoveries:\n", style="bold")
        for line in recent[-RECENT_SHOWN:]:
            stamp = time.strftime("%H:%M:%S", time.localtime(line["time"]))
            style = "red" if str(line["text"]).startswith("FAULT") else ""
            lines.append(f"  {stamp} ({_age(now - line['time'])} ago)  ", style="dim")
            lines.append(f"{line['text']}\n", style=style)
        parts.append(lines)
    return Group(*parts)


def _header(status: dict[str, Any]) -> Text:
    state = status.get("state", "?")
    style = {"running": "bold green", "recovering": "bold yellow", "succeeded": "bold blue",
             "failed": "bold red", "cancelled": "bold red"}.get(state, "bold")
    text = Text()
    text.append(f"job {status.get('job_id', '?')} ", style="bold")
    text.append(state, style=style)
    facts = [f"generation {status.get('generation')}", f"world {status.get('world_size')}",
             f"step {status.get('committed_step')}"]
    rate = status.get("steps_per_second")
    facts.append("- steps/s" if rate is None else f"{rate:.2f} steps/s")
    for name, stats in list((status.get("scalars") or {}).items())[:4]:
        facts.append(f"{name} {_number(stats.get('mean'))}")
    facts.append(f"recoveries {status.get('restart_count')}/{status.get('max_restarts')}")
    durable = status.get("durable_checkpoint")
    facts.append("no checkpoint in storage yet" if durable is None
                 else f"checkpoint step {durable['step']} ({_age(durable['age_seconds'])} old)")
    facts.append(f"up {_age(status.get('uptime_seconds') or 0)}")
    text.append("  " + " | ".join(facts))
    recovery = status.get("recovery")
    if recovery:
        text.append(f"\nrecovering: {recovery['strategy']} into generation {recovery['generation']}",
                    style="yellow")
        if recovery.get("waiting_for"):
            text.append(f", waiting for {recovery['waiting_for']}", style="yellow")
    if status.get("message"):
        text.append(f"\n{status['message']}")
    return text


def _rank_table(status: dict[str, Any]) -> Table:
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for column in ("node", "host", "rank", "pid", "phase", "step", "loss", "heartbeat", "gen"):
        table.add_column(column, justify="right" if column in ("rank", "pid", "step", "loss", "heartbeat", "gen")
                         else "left")
    nodes = status.get("nodes", {})
    for rank_text, rank in sorted(status.get("ranks", {}).items(), key=lambda item: int(item[0])):
        node = nodes.get(str(rank["node"]), {})
        phase = _phase(rank)
        table.add_row(str(rank["node"]), _node_host(node), rank_text, str(rank.get("pid") or "-"),
                      Text(phase, style=_PHASE_STYLE.get(phase, "red")), str(rank["step"]),
                      _number((rank.get("scalars") or {}).get("loss")), _beat(rank), str(rank.get("generation", "-")))
    for node_text, node in sorted(nodes.items(), key=lambda item: int(item[0])):
        if node.get("standby") or not node.get("alive"):
            table.add_row(node_text, _node_host(node), "-", str(node.get("pid") or "-"),
                          Text("spare" if node.get("alive") else "lost", style="dim" if node.get("alive") else "red"),
                          "", "", "", "")
    return table


def _node_table(status: dict[str, Any]) -> Table:
    """A large job: one row per node, its ranks summed up."""
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for column in ("node", "host", "ranks", "workers", "phases", "steps", "loss", "heartbeat", "gen"):
        table.add_column(column, justify="left" if column in ("node", "host", "phases") else "right")
    by_node: dict[int, list[dict[str, Any]]] = {}
    for rank_text, rank in status.get("ranks", {}).items():
        by_node.setdefault(int(rank["node"]), []).append({**rank, "rank": int(rank_text)})
    nodes = status.get("nodes", {})
    for node_id in sorted({*by_node, *(int(n) for n in nodes)}):
        node = nodes.get(str(node_id), {})
        ranks = sorted(by_node.get(node_id, []), key=lambda r: r["rank"])
        if not ranks:
            table.add_row(str(node_id), _node_host(node), "-", "-",
                          "spare" if node.get("alive") else "lost", "", "", "", "")
            continue
        phases = Counter(_phase(rank) for rank in ranks)
        steps = [rank["step"] for rank in ranks]
        losses = [rank["scalars"]["loss"] for rank in ranks if "loss" in (rank.get("scalars") or {})]
        beats = [rank["seconds_since_heartbeat"] for rank in ranks if rank.get("seconds_since_heartbeat") is not None]
        table.add_row(str(node_id), _node_host(node), f"{ranks[0]['rank']}-{ranks[-1]['rank']}",
                      str(sum(1 for rank in ranks if rank.get("pid"))),
                      ", ".join(f"{phase} {count}" for phase, count in phases.most_common()),
                      str(steps[0]) if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}",
                      _number(sum(losses) / len(losses)) if losses else "-",
                      f"{max(beats):.1f} s" if beats else "-",
                      ",".join(str(g) for g in sorted({int(rank["generation"]) for rank in ranks
                                                        if rank.get("generation") is not None})))
    return table


def _phase(rank: dict[str, Any]) -> str:
    if rank.get("exitcode") not in (None, 0):
        return f"exited {rank['exitcode']}"
    return "done" if rank.get("done") else str(rank.get("phase", "?"))


def _node_host(node: dict[str, Any]) -> str:
    return str(node.get("host") or "-")


def _beat(rank: dict[str, Any]) -> str:
    age = rank.get("seconds_since_heartbeat")
    return "-" if age is None else f"{age:.1f} s"


def _number(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.4g}"


def _age(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{seconds / 3600:.1f} h"


def watch(fetch: Callable[[], dict[str, Any]], interval: float, console: Console | None = None) -> dict[str, Any]:
    """Redraw the view in place every ``interval`` seconds until the job ends (returns its last
    status) or ``fetch`` raises (the controller went away: the error is the caller's)."""
    status = fetch()
    with Live(render_status(status), console=console, auto_refresh=False, transient=False) as live:
        while status.get("state") not in TERMINAL_STATES:
            time.sleep(interval)
            status = fetch()
            live.update(render_status(status), refresh=True)
    return status
