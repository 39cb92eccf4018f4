"""T2's writing pipeline without the disk: the shared shard written from a T1 slot into tmpfs, so that
only the CPU's part is timed (serialization, checksums, copies into the page cache), against
``torch.save`` of the same state into the same tmpfs.

One process, the engine's own classes: the state (stacked square linear layers and their AdamW
state) is written into a T1 slot, and ``write_shared_shard`` writes it from the slot's views, as
the persister does. Three cases, interleaved, wall and CPU seconds of each:

- ``undying``: as shipped, ``torch.save`` leaving out its per-record CRC-32 inside T2's
  checksummed streams (the file's own CRC-32 covers those bytes; checkpoint/dcp_writer.py);
- ``undying, record CRCs kept``: the same with ``torch.save`` computing its per-record CRC-32 too
  (what T2 did before);
- ``torch.save``: the whole state in one ``torch.save`` call.

    python bench/studies/t2_pipeline.py --layers 48 --repeats 5 --out bench/results/t2_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.serialization

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
from interleave import interleaved, medians  # noqa: E402
from square_layers import build  # noqa: E402

from undying.checkpoint import dcp_writer  # noqa: E402
from undying.checkpoint.dcp_format import optimizer_param_names, write_shared_shard  # noqa: E402
from undying.checkpoint.snapshot import RankSnapshots  # noqa: E402

CASES = ("undying", "undying, record CRCs kept", "torch.save")


def write_with_record_crcs(staging: Path, replica: dict[str, Any], names: list[list[str]]) -> None:
    """``write_shared_shard`` with ``torch.save``'s own per-record CRC-32 left on, as before."""
    wrap = dcp_writer._leave_out_record_crcs_in_checksummed_streams
    getter = torch.serialization.get_crc32_options
    dcp_writer._leave_out_record_crcs_in_checksummed_streams = lambda: None  # type: ignore[assignment]
    torch.serialization.get_crc32_options = lambda: True
    try:
        write_shared_shard(staging, replica, names)
    finally:
        dcp_writer._leave_out_record_crcs_in_checksummed_streams = wrap  # type: ignore[assignment]
        torch.serialization.get_crc32_options = getter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48, help="square layers of 2048 x 2048 (48: 201M parameters)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tmpfs", default="/dev/shm", help="a memory-backed directory to write into")
    parser.add_argument("--out", default="bench/results/t2_pipeline.json")
    args = parser.parse_args()
    model, optimizer = build(args.layers)
    names = [optimizer_param_names(optimizer, [model])]
    work = Path(tempfile.mkdtemp(prefix="undying-t2-pipeline-", dir=args.tmpfs))
    slots = RankSnapshots(work / "t1", rank=0, slots=2)
    replica: dict[str, Any] = {}
    try:
        live = {"committed_step": 1, "models": [model.state_dict()], "optimizers": [optimizer.state_dict()],
                "loaders": [], "statefuls": {}}
        slots.write({"replica": live, "rank": {}}, step=1, generation=1, world_size=1)
        replica = slots.read_slot(slots.pin(1), clone=False)["replica"]  # views into the slot
        state_bytes = sum(t.nbytes for t in model.parameters()) * 3

        def measure(case: str) -> dict:
            target = work / "out"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            started, cpu = time.perf_counter(), time.process_time()
            if case == "undying":
                write_shared_shard(target, replica, names)
            elif case == "undying, record CRCs kept":
                write_with_record_crcs(target, replica, names)
            else:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, target / "x.pt")
            record = {"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
                      "bytes": sum(f.stat().st_size for f in target.iterdir())}
            shutil.rmtree(target)
            return record

        measure("undying")  # not recorded: DCP's import and first-call costs
        records = interleaved(args.repeats, CASES, measure)
    finally:
        replica.clear()  # views into the slot: gone before it is unmapped
        slots.close()
        shutil.rmtree(work, ignore_errors=True)
    summary = {case: medians(records[case], ("wall_s", "cpu_s", "bytes")) for case in CASES}
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "torch": torch.__version__,
              "state_bytes": state_bytes, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"| {state_bytes / 2**30:.2f} GiB of state into tmpfs | wall s (median) | CPU s (median) |")
    print("| --- | --- | --- |")
    for case in CASES:
        print(f"| {case} | {summary[case]['wall_s']} | {summary[case]['cpu_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
