"""What the T1 snapshot's data checksum costs: a snapshot's write (copy, then the data's CRC-32 and
the commit) against the copy alone and the CRC-32 alone, for states of a few sizes.

A snapshot that does not overlap training (CPU state, ``checkpoint.overlap`` off) commits on the
training thread, so its stall is the copy plus the CRC-32 of the data (checkpoint/snapshot_slot.py);
an overlapped one computes it on the copy's helper thread. Each figure is the median of ``--repeats``
writes into node shared memory (/dev/shm), after two to warm the slots.

    python bench/t1_checksum.py --mib 64 256 --repeats 9 --out bench/results/t1_checksum.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from undying.checkpoint.copy import copy_now
from undying.checkpoint.crc import FAST_CRC, crc32
from undying.checkpoint.snapshot import RankSnapshots


def measure(mib: int, repeats: int) -> dict[str, float]:
    state = {"weights": [torch.randn(1 << 18) for _ in range(mib)]}  # 1 MiB each
    directory = Path(tempfile.mkdtemp(prefix="undying-bench-t1-", dir="/dev/shm"))
    snapshots = RankSnapshots(directory, rank=0, slots=2)
    try:
        write, copy, crc = [], [], []
        for step in range(repeats + 2):
            started = time.perf_counter()
            info = snapshots.write(state, step=step, generation=1, world_size=1)
            write.append(time.perf_counter() - started)
            snapshots.wait_reserved()
            assert info is not None
            slot = snapshots._slots[info.slot]  # the copy and the CRC-32 alone, on the same memory
            views = slot.lay_out(slot.layout or [])
            started = time.perf_counter()
            copy_now(views, state["weights"])
            copy.append(time.perf_counter() - started)
            with memoryview(slot._mm) as whole, whole[4096:4096 + info.nbytes] as data:  # type: ignore[arg-type]
                started = time.perf_counter()
                crc32(data)
                crc.append(time.perf_counter() - started)
        return {"mib": mib, "write_s": statistics.median(write[2:]), "copy_s": statistics.median(copy[2:]),
                "crc_s": statistics.median(crc[2:])}
    finally:
        snapshots.close()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [measure(mib, args.repeats) for mib in args.mib]
    print(f"zlib-ng CRC-32: {FAST_CRC}")
    print("| state | snapshot write (copy + CRC-32 + commit), median s | copy alone | CRC-32 alone |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['mib']} MiB | {row['write_s']:.4f} | {row['copy_s']:.4f} | {row['crc_s']:.4f} |")
    if args.out:
        args.out.write_text(json.dumps({"command": "python bench/t1_checksum.py " + " ".join(sys.argv[1:]),
                                        "fast_crc": FAST_CRC, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
