"""T2's load at a restore: the newest checkpoint verified and its shared shard read back into a model
and its optimizer, each load in a fresh process (as a restarted worker reads it), against
``torch.load`` of the same state from one file; the page cache dropped before each load (a node
that never held the files) and warm (read just before).

Cases, interleaved, each load in its own process:

- ``undying``: as a restore does it: ``latest_verified`` (the checkpoint's files checked side by
  side) and ``read_shared_shard`` (checkpoint/dcp_reader.py: data files on threads, tensors read
  whole kept as loaded), then ``load_state_dict`` of the model and the optimizer;
- ``undying before``: the same checkpoint through what T2's read was before: each file verified in
  turn, DCP's ``FileSystemReader`` with its empty-state-dict planner;
- ``torch.load``: the same state written once by ``torch.save`` into one file (fsynced), read with
  ``torch.load(weights_only=True)``.

Every case must end with the same parameter and optimizer-state digest. Dropping the page cache
needs root (``/proc/sys/vm/drop_caches``); without it only the warm rows are measured.

    python bench/t2_load.py --layers 48 --repeats 3 --out bench/results/t2_load.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
from interleave import interleaved, medians  # noqa: E402
from square_layers import WIDTH, build  # noqa: E402

from undying.checkpoint import commit, latest_verified, list_committed, staging_dir, verify_files  # noqa: E402
from undying.checkpoint.crc import crc32  # noqa: E402
from undying.checkpoint.dcp_format import (  # noqa: E402
    from_dcp,
    optimizer_param_names,
    read_shared_shard,
    write_shared_shard,
)

CASES = ("undying", "undying before", "torch.load")
PLAIN_FILE = "plain.pt"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
PEAK_RESET = Path("/proc/self/clear_refs")  # "5": the kernel's peak resident set restarts from the current one


def replica(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"committed_step": 1, "models": [model.state_dict()], "optimizers": [optimizer.state_dict()],
            "loaders": [{"epoch": 0, "position": 0, "seed": 0, "dataset_len": 1}], "statefuls": {}}


def write_checkpoints(work: Path, layers: int) -> int:
    """T2 of the state under ``work/root`` and ``torch.save`` of it in ``work/plain.pt``; its bytes."""
    model, optimizer = build(layers)
    root = work / "root"
    staging = staging_dir(root, 1, 1)
    records = write_shared_shard(staging, replica(model, optimizer), [optimizer_param_names(optimizer, [model])])
    commit(root, staging, step=1, generation=1, world_size=1, files=records)
    with open(work / PLAIN_FILE, "wb") as plain:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain)
        plain.flush()
        os.fsync(plain.fileno())
    return sum(record.size for record in records)


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """CRC-32 over every parameter and optimizer-state tensor, in a fixed order."""
    value = 0
    for parameter in model.parameters():
        value = crc32(parameter.detach().reshape(-1).view(torch.uint8).numpy(), value)
        for entry in sorted(optimizer.state[parameter].items()):
            value = crc32(entry[1].reshape(-1).view(torch.uint8).numpy(), value)
    return f"{value:08x}"


def load_before(root: Path) -> dict[str, Any]:
    """T2's read as it was: every file verified in turn, then DCP's own reader and planner."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint = list_committed(root)[0]
    for record in checkpoint.manifest.files:
        verify_files(checkpoint, [record.name])
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(checkpoint.path), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return from_dcp(state)


def child(case: str, work: Path, layers: int, warm: bool) -> dict[str, Any]:
    """One load in this fresh process: a model on the device (touched, as a live one is), a fresh
    AdamW, the state read and loaded into both."""
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False, device="meta") for _ in range(layers)])
    model.to_empty(device="cpu")
    for parameter in model.parameters():
        parameter.data.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    importlib.import_module("torch.distributed.checkpoint")  # before timing: a restore's worker has it already

    if warm:
        for path in [work / PLAIN_FILE, *sorted((work / "root").rglob("*"))]:
            if path.is_file():
                with open(path, "rb") as file:
                    while file.read(1 << 24):
                        pass
    rss_before = memory_mib("VmRSS")
    PEAK_RESET.write_text("5\n")  # the peak (VmHWM) from here on, not the process's earlier one
    started = time.perf_counter()
    if case == "torch.load":
        loaded = torch.load(work / PLAIN_FILE, weights_only=True)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    else:
        if case == "undying":
            checkpoint = latest_verified(work / "root")
            assert checkpoint is not None
            state = read_shared_shard(checkpoint, verified=True)
        else:
            state = load_before(work / "root")
        model.load_state_dict(state["models"][0])
        optimizer.load_state_dict(state["optimizers"][0])
    seconds = time.perf_counter() - started
    return {"load_s": round(seconds, 4), "peak_rss_growth_mib": round(memory_mib("VmHWM") - rss_before, 1),
            "digest": digest(model, optimizer)}


def memory_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def drop_page_cache() -> bool:
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
        return True
    except OSError:
        return False


def measure(work: Path, layers: int, case: str, cache: str) -> dict[str, Any]:
    if cache == "cold" and not drop_page_cache():
        raise SystemExit("cannot drop the page cache (needs root): run with --caches warm")
    done = subprocess.run([sys.executable, __file__, "--child", case, "--work", str(work), "--layers", str(layers),
                           *(["--warm"] if cache == "warm" else [])], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{case} ({cache}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48, help="square layers of 2048 x 2048 (48: 201M parameters)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--caches", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.work, args.layers, args.warm)))
        return
    work = Path(tempfile.mkdtemp(prefix="undying-t2-load-", dir=os.environ.get("UNDYING_BENCH_DIR")))
    try:
        nbytes = write_checkpoints(work, args.layers)
        print(f"{args.layers} layers: T2 of {nbytes / 2**30:.2f} GiB written", flush=True)
        rows = []
        for cache in args.caches:
            records = interleaved(args.repeats, CASES, lambda case, cache=cache: measure(work, args.layers, case, cache))
            for case in CASES:
                digests = {record["digest"] for record in records[case]}
                rows.append({"case": case, "cache": cache, "digests": sorted(digests),
                             **medians(records[case], ["load_s", "peak_rss_growth_mib"])})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    equal = len({digest for row in rows for digest in row["digests"]}) == 1
    print(f"\nall cases bitwise equal: {equal}\n\n| page cache | case | load s: median (runs) | peak RSS growth MiB |\n"
          "| --- | --- | --- | --- |")
    for row in rows:
        runs = ", ".join(f"{value:.2f}" for value in row["load_s_all"])
        print(f"| {row['cache']} | {row['case']} | {row['load_s']:.2f} ({runs}) | {row['peak_rss_growth_mib']:.0f} |")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "layers": args.layers,
                                        "state_bytes": nbytes, "bitwise_equal": equal, "rows": rows}, indent=1))
    if not equal:
        raise SystemExit("the cases loaded different state")


if __name__ == "__main__":
    main()
