"""The Markdown tables bench/checkpoint.py prints from its rows: persistence (stall, persist, load,
memory, GIL waits) and the training loop's cost per snapshot. Imported by that script only."""

from __future__ import annotations

from typing import Any


def table(rows: list[dict[str, Any]]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def gib(value: int | None) -> str:
        return "-" if value is None else f"{value / 2**30:.2f}"

    lines = ["| model | state GiB | copy_ s | undying stall s (x copy) | torch.save stall s | async_save stall s "
             "| persist s: undying / torch.save+fsync / async_save / write+fsync "
             "| persist CPU s: undying / torch.save+fsync / async_save / write+fsync | load s: T1 / T2 / torch.load "
             "| extra memory GiB: undying (T1 slots) / torch.save / async_save "
             "| training thread's GIL wait while persisting, max (p99) ms: undying / async_save |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        u, t, a, w = row["undying"], row["torch_save"], row.get("async_save", {}), row.get("write", {})
        label = f"{row['size']} ({row['parameters'] / 1e6:.0f}M{' + AdamW' if row['adamw'] else ', no optimizer state'})"
        ratio = u["stall_s"] / row["copy"]["stall_s"]
        def wait(result: dict[str, Any]) -> str:
            busy = result.get("gil_wait_persisting")
            return "-" if busy is None else f"{busy['max_s'] * 1e3:.1f} ({busy['p99_s'] * 1e3:.1f})"

        lines.append(
            f"| {label} | {row['state_bytes'] / 2**30:.2f} | {s(row['copy']['stall_s'])} | {s(u['stall_s'])} "
            f"({ratio:.2f}x) | {s(t['stall_s'])} | {s(a.get('stall_s'))} "
            f"| {s(u.get('persist_s'))} / {s(t['persist_s'])} / {s(a.get('persist_s'))} / {s(w.get('persist_s'))} "
            f"| {s(u.get('persist_cpu_s'))} / {s(t['persist_cpu_s'])} / {s(a.get('persist_cpu_s'))} "
            f"/ {s(w.get('persist_cpu_s'))} "
            f"| {s(u['load_t1_s'])} / {s(u.get('load_t2_s'))} / {s(t['load_s'])} "
            f"| {gib(u['extra_memory_bytes'])} / {gib(t['rss_delta_bytes'])} / {gib(a.get('rss_delta_bytes'))} "
            f"| {wait(u)} / {wait(a)} |")
    return "\n".join(lines)


def loop_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | batch | step s: no snapshot / boundary snapshot / overlapped snapshot "
             "| cost per snapshot s: boundary / overlapped (training thread blocked) "
             "| torch.save stall s | torch.save / overlapped cost |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        loop = row.get("loop")
        if loop is None:
            continue
        step, save = loop["step_s"], row["torch_save"]["stall_s"]
        cost = loop["cost_overlapped_s"]
        ratio = f"{save / cost:.0f}x" if cost > 0 else "cost below the noise"
        lines.append(f"| {row['size']} | {loop['batch']} | {step['none']:.3f} / {step['boundary']:.3f} / "
                     f"{step['overlapped']:.3f} | {loop['cost_boundary_s']:.3f} / {cost:.3f} "
                     f"({loop['blocked_overlapped_s']:.3f}) | {save:.3f} | {ratio} |")
    return "\n".join(lines)
