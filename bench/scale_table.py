"""The Markdown table bench/scale.py prints from its rows: the controller's CPU per job-second at each
number of ranks, its decision and plan times, memory growth and plan encoding. Imported by that
script only."""

from __future__ import annotations

import statistics
from typing import Any


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| ranks | heartbeats CPU s / job-s | polls CPU s / job-s | ticks CPU s / job-s (ms per tick) "
             "| loop wake-ups / job-s: earlier rule / news | ticks CPU s / job-s, earlier rule (estimated) "
             "| in-place: decision ms | in-place: plans to all ms | lost node: decision ms "
             "| lost node: plans to all ms | RSS growth MiB | traced MiB | plan replies JSON: each apart / once s "
             "| plan reply bytes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        steady = row["steady"]

        def ms(fault: str, key: str, r: dict[str, Any] = row) -> str:
            values = [1000 * one[key] for one in r[fault]]
            return f"{statistics.median_high(values):.1f} ({', '.join(f'{v:.1f}' for v in values)})"
        lines.append(
            f"| {row['ranks']} | {steady['heartbeats_cpu_per_s']:.3f} | {steady['polls_cpu_per_s']:.4f} "
            f"| {steady['ticks_cpu_per_s']:.3f} ({steady['tick_ms']:.2f}) "
            f"| {steady['wakes_before_per_s']:.0f} / {steady['news_ticks_per_s']:.0f} "
            f"| {steady['ticks_before_cpu_per_s']:.2f} "
            f"| {ms('in_place', 'decision_cpu_s')} | {ms('in_place', 'plans_to_all_cpu_s')} "
            f"| {ms('lost_node', 'decision_cpu_s')} | {ms('lost_node', 'plans_to_all_cpu_s')} "
            f"| {row['rss_growth_bytes'] / 2**20:.1f} | {row['traced_bytes'] / 2**20:.1f} "
            f"| {statistics.median_high([one['plan_encode_each_cpu_s'] for one in row['in_place']]):.2f} / "
            f"{statistics.median_high([one['plan_encode_once_cpu_s'] for one in row['in_place']]):.3f} "
            f"| {row['in_place'][0]['plan_reply_bytes']:.0f} |")
    return "\n".join(lines)
