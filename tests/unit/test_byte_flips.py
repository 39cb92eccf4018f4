"""Random byte flips in T1 slots and T2 files: a damaged snapshot or checkpoint is never loaded,
and the next valid source is used.

Seeded, so a failure names its flip. T2: one byte of any file of the newest committed checkpoint
(a rank's data file or the manifest) flipped; the checkpoint before it is the one verified and
loaded, the damaged one reported (the end-to-end case, a job restart that skips a damaged newest
checkpoint, is tests/faults/test_job_restart.py). T1: one byte of a slot's header fields, commit
word, data or meta block flipped, in node shared memory; a process that opens the slots (a restart,
a replacement) does not see that snapshot, the writer's own process refuses to read it, and the
older snapshot is read bitwise.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.unit.test_checkpoint_storage import CorruptLog, flip_byte, rank_file, write_checkpoint
from undying.checkpoint import MANIFEST_NAME, checkpoint_dirname, latest_verified, load_object
from undying.checkpoint.snapshot import RankSnapshots
from undying.checkpoint.snapshot_slot import (
    _HEADER,
    _HEADER_CRC_OFFSET,
    _STATE_OFFSET,
    HEADER_BYTES,
    CorruptSnapshot,
)

FLIPS = 24
SEED = 30


def test_a_byte_flipped_anywhere_in_the_newest_t2_checkpoint_falls_back_to_the_one_before(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    pristine = tmp_path / "pristine"
    write_checkpoint(pristine, 10)
    newest = write_checkpoint(pristine, 20)
    names = sorted(path.name for path in newest.path.iterdir())
    assert MANIFEST_NAME in names and rank_file(1) in names
    for flip in range(FLIPS):
        root = tmp_path / f"flip{flip}"
        shutil.copytree(pristine, root)
        name = rng.choice(names)
        path = root / checkpoint_dirname(20) / name
        offset = rng.randrange(path.stat().st_size)
        flip_byte(path, offset)
        log = CorruptLog()
        verified = latest_verified(root, on_corrupt=log)
        where = f"flip {flip}: {name} byte {offset}"
        assert verified is not None and verified.step == 10, where
        assert [path.name for path, _ in log.calls] == [checkpoint_dirname(20)], where
        assert load_object(verified, rank_file(1))["step"] == 10, where


def state_of(step: int) -> dict:
    """A rank's state whose every element says its step: a mix of two snapshots cannot pass for one."""
    return {"replica": {"weights": [torch.full((4096,), float(step)), torch.full((33, 7), float(step))],
                        "position": step},
            "rank": {"rng": torch.full((16,), step, dtype=torch.uint8)}}


def slot_files(directory: Path) -> dict[int, Path]:
    """Each slot file by the step it holds (as a fresh reader sees them)."""
    reader = RankSnapshots(directory, rank=0)
    try:
        return {info.step: directory / f"rank{0:05d}.slot{info.slot}" for info in reader.committed()}
    finally:
        reader.close()


def meaningful_offsets(path: Path, rng: random.Random) -> list[tuple[str, int]]:
    """One offset in each part a flip must be caught in: header fields, commit word, header CRC,
    data region, meta block (padding the slot does not use is left out: nothing reads it)."""
    header = _HEADER.unpack_from(path.read_bytes()[:_HEADER.size])
    data_bytes, meta_offset, meta_bytes = header[6], header[7], header[8]
    return [("header", rng.randrange(_HEADER.size)), ("commit word", _STATE_OFFSET + rng.randrange(4)),
            ("header crc", _HEADER_CRC_OFFSET + rng.randrange(4)),
            ("data", HEADER_BYTES + rng.randrange(data_bytes)), ("meta", meta_offset + rng.randrange(meta_bytes))]


def test_a_byte_flipped_in_a_t1_slot_is_never_loaded_and_the_older_snapshot_is(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    for flip in range(FLIPS // 4):
        directory = tmp_path / f"node{flip}"
        writer = RankSnapshots(directory, rank=0, slots=2)
        writer.write(state_of(1), step=1, generation=1, world_size=1)
        writer.wait_reserved()
        writer.write(state_of(2), step=2, generation=1, world_size=1)
        newest = slot_files(directory)[2]
        for part, offset in meaningful_offsets(newest, rng):
            original = newest.read_bytes()[offset]
            flip_byte(newest, offset)
            where = f"flip {flip}: {part} byte {offset}"
            # Another process (a restart, a replacement on this node) opening the slots.
            reader = RankSnapshots(directory, rank=0)
            assert [info.step for info in reader.committed()] == [1], where
            with pytest.raises(KeyError):
                reader.read(2)
            assert reader.read(1)["replica"]["weights"][0].eq(1.0).all(), where
            reader.close()
            # The writer's own process: the step is still listed from before the flip, but never read.
            if part == "data":
                with pytest.raises(CorruptSnapshot):
                    writer.read(2)
                assert [info.step for info in writer.committed()] == [1], where
            assert writer.read(1)["replica"]["position"] == 1, where
            flip_byte(newest, offset)  # restored: the next part is flipped alone
            assert newest.read_bytes()[offset] == original
            writer.close()
            writer = RankSnapshots(directory, rank=0, slots=2)  # re-reads the restored slot
            assert [info.step for info in writer.committed()] == [2, 1], where
        writer.close()
