"""T2 checkpoint storage: round trips, atomic commit, and refusal of corrupt checkpoints, under a local
root and under an fsspec URL root."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fsspec.core import url_to_fs

from undying.checkpoint import (
    MANIFEST_NAME,
    CommittedCheckpoint,
    CorruptCheckpoint,
    FileRecord,
    Manifest,
    checkpoint_dirname,
    commit,
    is_url,
    latest_verified,
    list_committed,
    load_object,
    make_root,
    prune,
    remove_stale_partials,
    root_location,
    save_object,
    staging_dir,
    verify,
)
from undying.checkpoint.backend import Location, StorageBackend
from undying.checkpoint.local_backend import LocalBackend
from undying.checkpoint.manifest import PARTIAL_RE, checksum_bytes, generation_dir_id
from undying.checkpoint.storage import backend_for
from undying.checkpoint.url_backend import UrlBackend

WORLD_SIZE = 2


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


def write_checkpoint(
    root: Path, step: int, generation: int = 0, keep: int | None = None
) -> CommittedCheckpoint:
    """The worker protocol in one process: every rank saves, rank 0 commits."""
    staging = staging_dir(root, step, generation)
    records = [
        save_object(
            staging, rank_file(rank), {"step": step, "rank": rank, "weights": torch.full((64,), step)}
        )
        for rank in range(WORLD_SIZE)
    ]
    return commit(
        root,
        staging,
        step=step,
        generation=generation,
        world_size=WORLD_SIZE,
        files=records,
        meta={"step": step},
        keep=keep,
    )


class CorruptLog:
    """An ``on_corrupt`` callback that remembers what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, str]] = []

    def __call__(self, path: Path, reason: str) -> None:
        self.calls.append((path, reason))


def assert_falls_back(root: Path, bad_step: int, good_step: int, reason_part: str) -> None:
    log = CorruptLog()
    ckpt = latest_verified(root, on_corrupt=log)
    assert ckpt is not None and ckpt.step == good_step
    assert len(log.calls) == 1
    path, reason = log.calls[0]
    assert path == root / checkpoint_dirname(bad_step)
    assert reason_part in reason, reason


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------- round trip


def test_round_trip_of_tensors_and_rng_states(tmp_path: Path) -> None:
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    generator = np.random.default_rng(7)
    state: dict[str, Any] = {
        "model": {"weight": torch.randn(4, 3), "bias": torch.arange(3, dtype=torch.float64)},
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "numpy_generator": generator.bit_generator.state,
        "torch_rng": torch.get_rng_state(),
        "data_position": 1234,
    }
    expected_draws = (random.random(), np.random.rand(5), generator.random(5), torch.rand(5))

    staging = staging_dir(str(tmp_path), 5, generation=1)
    record = save_object(staging, "rank_0.pt", state)
    assert record.checksum.startswith("crc32:") and len(record.checksum) == len("crc32:") + 8
    assert record.size == (staging / "rank_0.pt").stat().st_size
    ckpt = commit(tmp_path, staging, step=5, generation=1, world_size=1, files=[record], meta={"lr": 0.1})

    assert ckpt.path == tmp_path / "step_000000005" and not staging.exists()
    [listed] = list_committed(tmp_path)
    assert listed.step == 5 and listed.manifest == ckpt.manifest
    assert listed.manifest.meta == {"lr": 0.1} and listed.manifest.generation == 1

    verified = latest_verified(tmp_path)
    assert verified is not None
    loaded = load_object(verified, "rank_0.pt")
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert torch.equal(loaded["model"]["bias"], state["model"]["bias"])
    assert loaded["data_position"] == 1234

    random.setstate(loaded["python_rng"])
    np.random.set_state(loaded["numpy_rng"])
    restored = np.random.default_rng()
    restored.bit_generator.state = loaded["numpy_generator"]
    torch.set_rng_state(loaded["torch_rng"])
    assert random.random() == expected_draws[0]
    assert np.array_equal(np.random.rand(5), expected_draws[1])
    assert np.array_equal(restored.random(5), expected_draws[2])
    assert torch.equal(torch.rand(5), expected_draws[3])


def test_manifest_json_round_trip_normalises_meta() -> None:
    manifest = Manifest(
        step=3,
        generation=2,
        world_size=4,
        files=[FileRecord("a.pt", 10, "crc32:0000abcd")],
        meta={"nested": {"x": [1, 2]}},
        created=1.5,
    )
    assert Manifest.from_json(manifest.to_json()) == manifest
    int_keys = Manifest(step=3, generation=2, world_size=4, files=[], meta={2: "a", 10: "b"}, created=1.5)
    assert Manifest.from_json(int_keys.to_json()).meta == {"2": "a", "10": "b"}


def test_checkpoint_dirname() -> None:
    assert checkpoint_dirname(0) == "step_000000000"
    assert checkpoint_dirname(123) == "step_000000123"
    with pytest.raises(ValueError):
        checkpoint_dirname(-1)


# -------------------------------------------------------------------- atomicity


def test_uncommitted_staging_is_never_listed(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    staging = staging_dir(tmp_path, 20, generation=0)
    save_object(staging, rank_file(0), {"x": 1})
    # Even a manifest-looking file inside a partial does not make it a checkpoint.
    (staging / MANIFEST_NAME).write_text("{}")

    assert [ckpt.step for ckpt in list_committed(tmp_path)] == [10]
    log = CorruptLog()
    assert latest_verified(tmp_path, on_corrupt=log).step == 10
    assert log.calls == []


def test_staging_dir_is_shared_by_concurrent_callers(tmp_path: Path) -> None:
    first = staging_dir(tmp_path / "ckpt", 4, generation=2)
    second = staging_dir(tmp_path / "ckpt", 4, generation=2)
    assert first == second == tmp_path / "ckpt" / "step_000000004.g2.partial"
    assert first.is_dir()


def test_no_temp_files_remain_after_save(tmp_path: Path) -> None:
    staging = staging_dir(tmp_path, 1, 0)
    save_object(staging, "a.pt", [1, 2, 3])
    assert sorted(p.name for p in staging.iterdir()) == ["a.pt"]


def test_empty_root_has_no_checkpoint(tmp_path: Path) -> None:
    assert list_committed(tmp_path / "missing") == []
    assert latest_verified(tmp_path / "missing") is None


def test_commit_with_missing_file_commits_nothing(tmp_path: Path) -> None:
    staging = staging_dir(tmp_path, 7, 0)
    record = save_object(staging, rank_file(0), {"x": 1})
    ghost = FileRecord(rank_file(1), 10, "crc32:00000000")
    with pytest.raises(CorruptCheckpoint, match="missing"):
        commit(tmp_path, staging, step=7, generation=0, world_size=2, files=[record, ghost])
    assert list_committed(tmp_path) == []
    assert not (staging / MANIFEST_NAME).exists()


def test_commit_with_wrong_size_commits_nothing(tmp_path: Path) -> None:
    staging = staging_dir(tmp_path, 7, 0)
    record = save_object(staging, rank_file(0), {"x": 1})
    wrong = FileRecord(record.name, record.size + 1, record.checksum)
    with pytest.raises(CorruptCheckpoint, match="size"):
        commit(tmp_path, staging, step=7, generation=0, world_size=1, files=[wrong])
    assert list_committed(tmp_path) == []


def test_commit_rejects_a_staging_dir_of_another_step(tmp_path: Path) -> None:
    staging = staging_dir(tmp_path, 7, 0)
    record = save_object(staging, rank_file(0), {"x": 1})
    with pytest.raises(ValueError):
        commit(tmp_path, staging, step=8, generation=0, world_size=1, files=[record])


def test_save_rejects_names_outside_the_directory(tmp_path: Path) -> None:
    staging = staging_dir(tmp_path, 1, 0)
    for name in ["../escape.pt", "sub/file.pt", "", MANIFEST_NAME, "x.tmp"]:
        with pytest.raises(ValueError):
            save_object(staging, name, 1)


# -------------------------------------------------------------------- corruption


def test_flipped_byte_falls_back_to_previous(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    bad = write_checkpoint(tmp_path, 20)
    flip_byte(bad.path / rank_file(1), 100)
    assert_falls_back(tmp_path, 20, 10, "checksum")


def test_truncated_file_falls_back_to_previous(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    bad = write_checkpoint(tmp_path, 20)
    path = bad.path / rank_file(0)
    path.write_bytes(path.read_bytes()[:-10])
    assert_falls_back(tmp_path, 20, 10, "size")


def test_missing_data_file_falls_back_to_previous(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    bad = write_checkpoint(tmp_path, 20)
    (bad.path / rank_file(1)).unlink()
    assert_falls_back(tmp_path, 20, 10, "missing")


def test_missing_manifest_falls_back_to_previous(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    bad = write_checkpoint(tmp_path, 20)
    (bad.path / MANIFEST_NAME).unlink()
    assert [ckpt.step for ckpt in list_committed(tmp_path)] == [10]
    assert_falls_back(tmp_path, 20, 10, "manifest missing")


def test_unparseable_manifest_falls_back_to_previous(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    bad = write_checkpoint(tmp_path, 20)
    manifest = bad.path / MANIFEST_NAME
    manifest.write_text(manifest.read_text()[:-20])
    assert [ckpt.step for ckpt in list_committed(tmp_path)] == [10]
    assert_falls_back(tmp_path, 20, 10, "bad manifest")


def test_manifest_edit_that_keeps_valid_json_is_detected(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    bad = write_checkpoint(tmp_path, 20)
    manifest = bad.path / MANIFEST_NAME
    raw = json.loads(manifest.read_text())
    raw["meta"]["step"] = 21
    manifest.write_text(json.dumps(raw))
    assert_falls_back(tmp_path, 20, 10, "manifest checksum")


def test_manifest_naming_another_step_is_rejected(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    bad = write_checkpoint(tmp_path, 20)
    bad.path.rename(tmp_path / checkpoint_dirname(30))
    assert_falls_back(tmp_path, 30, 10, "does not match")


def test_manifest_path_escape_is_rejected(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    bad = write_checkpoint(tmp_path, 20)
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"secret")
    escaping = Manifest(
        step=20,
        generation=0,
        world_size=1,
        files=[FileRecord("../outside.pt", 6, "crc32:00000000")],
        meta={},
        created=0.0,
    )
    (bad.path / MANIFEST_NAME).write_text(escaping.to_json())
    assert_falls_back(tmp_path, 20, 10, "invalid checkpoint file name")


def test_symlink_out_of_the_directory_fails_verify(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, 10)
    target = tmp_path / "elsewhere.pt"
    (ckpt.path / rank_file(0)).rename(target)
    (ckpt.path / rank_file(0)).symlink_to(target)
    with pytest.raises(CorruptCheckpoint, match="outside"):
        verify(ckpt)


def test_all_corrupt_gives_none(tmp_path: Path) -> None:
    bad = write_checkpoint(tmp_path, 10)
    flip_byte(bad.path / rank_file(0), 50)
    log = CorruptLog()
    assert latest_verified(tmp_path, on_corrupt=log) is None
    assert [path for path, _ in log.calls] == [bad.path]


def test_non_canonical_directory_names_are_ignored(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    for name in ["step_10", "step_0000000010", "step_000000010.old", "step_abcdefghi"]:
        (tmp_path / name).mkdir()
    (tmp_path / "step_000000011").write_text("a file, not a directory")
    log = CorruptLog()
    assert [ckpt.step for ckpt in list_committed(tmp_path)] == [10]
    assert latest_verified(tmp_path, on_corrupt=log).step == 10
    assert log.calls == []


def test_load_object_never_unpickles_corrupt_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = write_checkpoint(tmp_path, 10)

    def forbidden_load(*args: object, **kwargs: object) -> None:
        pytest.fail("torch.load called on unverified bytes")

    monkeypatch.setattr(torch, "load", forbidden_load)

    flip_byte(ckpt.path / rank_file(0), 100)
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        load_object(ckpt, rank_file(0))

    path = ckpt.path / rank_file(1)
    path.write_bytes(path.read_bytes() + b"extra")
    with pytest.raises(CorruptCheckpoint, match="size"):
        load_object(ckpt, rank_file(1))

    path.unlink()
    with pytest.raises(CorruptCheckpoint, match="missing"):
        load_object(ckpt, rank_file(1))


def test_load_object_of_unknown_name_raises_key_error(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, 10)
    with pytest.raises(KeyError):
        load_object(ckpt, "rank_9.pt")


# ------------------------------------------------------------ replace and clean


def test_recommit_of_same_step_replaces_it(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10, generation=0)
    staging = staging_dir(tmp_path, 10, generation=1)
    record = save_object(staging, "only.pt", {"new": True})
    commit(tmp_path, staging, step=10, generation=1, world_size=1, files=[record])

    [ckpt] = list_committed(tmp_path)
    assert ckpt.manifest.generation == 1
    assert [r.name for r in ckpt.manifest.files] == ["only.pt"]
    assert not (ckpt.path / rank_file(0)).exists()
    assert load_object(latest_verified(tmp_path), "only.pt") == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000010"]


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        write_checkpoint(tmp_path, step)
    live = staging_dir(tmp_path, 50, generation=0)
    save_object(live, rank_file(0), 1)

    removed = prune(tmp_path, keep=2)
    assert sorted(removed) == [tmp_path / checkpoint_dirname(10), tmp_path / checkpoint_dirname(20)]
    assert [ckpt.step for ckpt in list_committed(tmp_path)] == [40, 30]
    assert (live / rank_file(0)).exists()
    assert not any(p.name.endswith(".replaced") for p in tmp_path.iterdir())


def test_commit_with_keep_prunes(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        write_checkpoint(tmp_path, step, keep=3)
    assert [ckpt.step for ckpt in list_committed(tmp_path)] == [5, 4, 3]


def test_remove_stale_partials(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10, generation=1)
    old = staging_dir(tmp_path, 20, generation=1)
    current = staging_dir(tmp_path, 20, generation=2)
    replaced = tmp_path / "step_000000010.g0.replaced"
    replaced.mkdir()
    (tmp_path / "unrelated").mkdir()

    removed = remove_stale_partials(tmp_path, current_generation=2)
    assert sorted(removed) == sorted([old, replaced])
    assert current.is_dir() and (tmp_path / "unrelated").is_dir()
    assert [ckpt.step for ckpt in list_committed(tmp_path)] == [10]
    assert remove_stale_partials(tmp_path / "missing", 0) == []


# ------------------------------------------------------------- URL roots (fsspec)
# The same protocol behind an fsspec URL, on fsspec's in-process memory:// filesystem: no rename,
# each generation writes step_<N>.g<G>/ in place, and the manifest (written last) is the commit.




def url_fs(url: str) -> tuple[Any, str]:
    return url_to_fs(url)


def url_files(root: str) -> list[str]:
    """Every object under ``root``, relative to it."""
    fs, path = url_fs(root)
    return sorted(name[len(path) + 1:] for name in fs.find(path))


def flip_url_byte(url: str, offset: int) -> None:
    fs, path = url_fs(url)
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def test_is_url_and_root_location() -> None:
    assert is_url("s3://bucket/ckpt") and is_url("file:///tmp/ckpt") and is_url("memory://x")
    assert not is_url("/tmp/ckpt") and not is_url("runs/x") and not is_url(Path("/tmp/ckpt"))
    assert root_location("file:///tmp/ckpt") == "file:///tmp/ckpt"
    assert root_location("/tmp/ckpt") == Path("/tmp/ckpt")


def test_url_round_trip_commits_in_place(url_root: str) -> None:
    staging = staging_dir(url_root, 5, generation=1)
    assert staging == f"{url_root}/step_000000005.g1"
    record = save_object(staging, "rank_0.pt", {"weights": torch.arange(6.0), "position": 12})
    assert url_files(url_root) == ["step_000000005.g1/rank_0.pt"]
    ckpt = commit(url_root, staging, step=5, generation=1, world_size=1, files=[record], meta={"lr": 0.1})

    assert ckpt.path == staging  # nothing renamed: the manifest made the directory a checkpoint
    assert url_files(url_root) == ["step_000000005.g1/MANIFEST.json", "step_000000005.g1/rank_0.pt"]
    [listed] = list_committed(url_root)
    assert listed.path == staging and listed.manifest == ckpt.manifest and listed.manifest.meta == {"lr": 0.1}
    verified = latest_verified(url_root)
    assert verified is not None
    verify(verified)
    loaded = load_object(verified, "rank_0.pt")
    assert torch.equal(loaded["weights"], torch.arange(6.0)) and loaded["position"] == 12


def test_url_step_without_manifest_is_not_listed(url_root: str) -> None:
    """A persister killed before the manifest: its files stay, nobody lists, loads or reports them,
    and the next generation's cleanup removes them."""
    write_checkpoint(url_root, 10, generation=1)
    killed = staging_dir(url_root, 20, generation=1)
    save_object(killed, rank_file(0), {"x": 1})
    live = staging_dir(url_root, 30, generation=2)  # the current generation's write in progress
    save_object(live, rank_file(0), {"x": 2})

    assert [ckpt.step for ckpt in list_committed(url_root)] == [10]
    log = CorruptLog()
    assert latest_verified(url_root, on_corrupt=log).step == 10
    assert log.calls == []
    assert remove_stale_partials(url_root, current_generation=2) == [killed]
    assert url_files(url_root) == sorted(["step_000000010.g1/MANIFEST.json", "step_000000010.g1/rank_0.pt",
                                          "step_000000010.g1/rank_1.pt", "step_000000030.g2/rank_0.pt"])


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_url_corrupt_file_falls_back_to_previous(url_root: str, damage: str) -> None:
    previous = write_checkpoint(url_root, 10)
    newest = write_checkpoint(url_root, 20)
    fs, path = url_fs(f"{newest.path}/{rank_file(1)}")
    if damage == "flip":
        flip_url_byte(f"{newest.path}/{rank_file(1)}", 100)
    elif damage == "truncate":
        fs.pipe_file(path, fs.cat_file(path)[:-1])
    else:
        fs.rm_file(path)

    log = CorruptLog()
    ckpt = latest_verified(url_root, on_corrupt=log)
    assert ckpt is not None and ckpt.path == previous.path
    [(where, reason)] = log.calls
    assert where == newest.path and rank_file(1) in reason
    assert {"flip": "checksum", "truncate": "size", "delete": "missing"}[damage] in reason
    assert load_object(ckpt, rank_file(1))["step"] == 10


def test_url_load_object_never_unpickles_corrupt_bytes(url_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = write_checkpoint(url_root, 10)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called on unverified bytes"))
    flip_url_byte(f"{ckpt.path}/{rank_file(0)}", 100)
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        load_object(ckpt, rank_file(0))


def test_url_edited_or_misplaced_manifest_is_rejected(url_root: str) -> None:
    write_checkpoint(url_root, 10, generation=1)
    edited = write_checkpoint(url_root, 20, generation=1)
    fs, manifest_path = url_fs(f"{edited.path}/{MANIFEST_NAME}")
    text = json.loads(fs.cat_file(manifest_path))
    text["world_size"] = 1  # valid JSON, wrong checksum
    fs.pipe_file(manifest_path, json.dumps(text).encode())
    # A valid manifest copied into the directory of another step is not that step's checkpoint.
    moved = staging_dir(url_root, 30, generation=1)
    fs.pipe_file(url_fs(f"{moved}/{MANIFEST_NAME}")[1], fs.cat_file(url_fs(f"{url_root}/step_000000010.g1/"
                                                                            f"{MANIFEST_NAME}")[1]))
    log = CorruptLog()
    assert latest_verified(url_root, on_corrupt=log).step == 10
    assert log.calls == [(moved, log.calls[0][1]), (edited.path, log.calls[1][1])]
    assert "step 10, generation 1 do not match directory step_000000030.g1" in log.calls[0][1]
    assert "manifest checksum mismatch" in log.calls[1][1]


def test_url_recommit_of_same_step_replaces_the_older_generation(url_root: str) -> None:
    write_checkpoint(url_root, 10, generation=0)
    staging = staging_dir(url_root, 10, generation=1)
    record = save_object(staging, "only.pt", {"new": True})
    commit(url_root, staging, step=10, generation=1, world_size=1, files=[record])
    [ckpt] = list_committed(url_root)
    assert ckpt.manifest.generation == 1 and load_object(latest_verified(url_root), "only.pt") == {"new": True}
    assert url_files(url_root) == ["step_000000010.g1/MANIFEST.json", "step_000000010.g1/only.pt"]


def test_url_a_step_committed_by_two_generations_counts_once(url_root: str) -> None:
    """A commit interrupted before it deleted the older generation's copy: the newer one counts, and
    the cleanup removes the older."""
    older = write_checkpoint(url_root, 10, generation=0)
    newer = write_checkpoint(url_root, 10, generation=1)
    fs, path = url_fs(url_root)
    # Put the older copy back as the interrupted commit would have left it.
    assert not fs.exists(url_fs(older.path)[1])
    staging = staging_dir(url_root, 10, generation=0)
    records = [save_object(staging, rank_file(rank), {"old": rank}) for rank in range(WORLD_SIZE)]
    fs.pipe_file(url_fs(f"{staging}/{MANIFEST_NAME}")[1], Manifest(
        step=10, generation=0, world_size=WORLD_SIZE, files=records, meta={}, created=0.0).to_json().encode())

    assert [c.path for c in list_committed(url_root)] == [newer.path]
    assert latest_verified(url_root).path == newer.path
    assert remove_stale_partials(url_root, current_generation=1) == [older.path]
    assert [c.path for c in list_committed(url_root)] == [newer.path]


def test_url_commit_with_missing_file_commits_nothing(url_root: str) -> None:
    write_checkpoint(url_root, 10)
    staging = staging_dir(url_root, 20, generation=0)
    record = save_object(staging, rank_file(0), {"x": 1})
    with pytest.raises(CorruptCheckpoint, match="missing at commit"):
        commit(url_root, staging, step=20, generation=0, world_size=2, keep=1,
               files=[record, FileRecord(rank_file(1), 10, "crc32:00000000")])
    assert [ckpt.step for ckpt in list_committed(url_root)] == [10]  # nothing pruned either
    with pytest.raises(ValueError, match="not the directory of step 20, generation 1"):
        commit(url_root, staging, step=20, generation=1, world_size=1, files=[record])


def test_url_prune_deletes_only_after_the_commit_and_the_manifest_first(
        url_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = write_checkpoint(url_root, 10)
    fs, _ = url_fs(url_root)
    calls: list[tuple[str, str]] = []
    for method in ("pipe_file", "rm_file", "rm"):
        original = getattr(fs, method)

        def spy(path: str, *args: Any, _method: str = method, _original: Any = original, **kwargs: Any) -> Any:
            calls.append((_method, path.rsplit("/ckpt/", 1)[-1]))
            return _original(path, *args, **kwargs)

        monkeypatch.setattr(fs, method, spy)
    write_checkpoint(url_root, 20, keep=1)

    assert calls[:4] == [
        ("pipe_file", "step_000000020.g0/rank_0.pt"),
        ("pipe_file", "step_000000020.g0/rank_1.pt"),
        ("pipe_file", "step_000000020.g0/MANIFEST.json"),  # the commit ...
        ("rm_file", "step_000000010.g0/MANIFEST.json"),  # ... then the prune: no longer a checkpoint
    ]
    assert calls[4] == ("rm", "step_000000010.g0")  # ... then its files (rm may call rm_file per file)
    assert all(path.startswith("step_000000010.g0/") for _, path in calls[5:])
    assert [c.step for c in list_committed(url_root)] == [20]
    assert not fs.exists(url_fs(first.path)[1])


def test_url_prune_keeps_the_newest(url_root: str) -> None:
    for step in (10, 20, 30, 40):
        write_checkpoint(url_root, step)
    live = staging_dir(url_root, 50, generation=0)
    save_object(live, rank_file(0), 1)
    removed = prune(url_root, keep=2)
    assert removed == [f"{url_root}/step_000000020.g0", f"{url_root}/step_000000010.g0"]
    assert [ckpt.step for ckpt in list_committed(url_root)] == [40, 30]
    assert f"step_000000050.g0/{rank_file(0)}" in url_files(url_root)


def test_url_empty_or_missing_root_has_no_checkpoint(url_root: str) -> None:
    assert list_committed(url_root) == [] and latest_verified(url_root) is None
    assert remove_stale_partials(url_root, 0) == []
    make_root(url_root)
    assert list_committed(url_root) == []


def test_file_url_takes_the_url_protocol(tmp_path: Path) -> None:
    """A file:// URL is a URL like any other: written in place, committed by the manifest."""
    root = f"file://{tmp_path}/ckpt"
    write_checkpoint(root, 10, generation=3)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000000010.g3"]
    ckpt = latest_verified(root)
    assert ckpt is not None and ckpt.path == f"{root}/step_000000010.g3"
    assert load_object(ckpt, rank_file(1))["rank"] == 1


# ------------------------------------------------------- the storage backend interface
# Both backends pass the same contract: what the commit protocol in storage.py relies on.


@pytest.fixture(params=["local", "memory-url", "file-url"])
def backend_root(request: pytest.FixtureRequest, tmp_path: Path, url_root: str) -> Location:
    return {"local": tmp_path / "ckpt", "memory-url": url_root, "file-url": f"file://{tmp_path}/ckpt"}[request.param]


def test_backend_for_picks_by_location(backend_root: Location) -> None:
    expected = UrlBackend if is_url(backend_root) else LocalBackend
    assert isinstance(backend_for(backend_root), expected)


def test_backend_files_are_written_whole_and_read_back(backend_root: Location) -> None:
    backend: StorageBackend = backend_for(backend_root)
    backend.make_root(backend_root)
    staging = backend.staging_dir(backend_root, 3, 1)
    assert backend.staging_dir(backend_root, 3, 1) == staging  # every rank may ask
    backend.check_staging(backend_root, staging, 3, 1)
    with pytest.raises(ValueError):
        backend.check_staging(backend_root, staging, 4, 1)

    data = b"undying" * 1000
    backend.write_file(staging, "a.bin", data)
    backend.sync_file(staging, "a.bin")
    assert backend.file_size(staging, "a.bin") == len(data)
    assert backend.file_checksum(staging, "a.bin") == (len(data), checksum_bytes(data))
    assert backend.read_file(staging, "a.bin") == data
    for read in (backend.file_size, backend.file_checksum, backend.read_file):
        with pytest.raises(FileNotFoundError):
            read(staging, "missing.bin")
    backend.check_member(staging, "a.bin")
    with pytest.raises(CorruptCheckpoint):
        backend.check_member(staging, "../a.bin")


def test_backend_lists_only_what_was_published(backend_root: Location) -> None:
    backend = backend_for(backend_root)
    staging = backend.staging_dir(backend_root, 3, 1)
    backend.write_file(staging, "a.bin", b"x")
    assert list(backend.scan(backend_root)) == []  # files alone are not a checkpoint

    manifest = Manifest(step=3, generation=1, world_size=1, files=[FileRecord("a.bin", 1, checksum_bytes(b"x"))],
                        meta={}, created=0.0).to_json().encode()
    backend.write_file(staging, MANIFEST_NAME, manifest)
    final = backend.publish(backend_root, staging, 3, 1)
    [stored] = backend.scan(backend_root)
    assert (stored.location, stored.step, stored.text) == (final, 3, manifest)
    assert stored.generation in (None, 1)  # 1 where the directory's name carries it
    assert backend.read_file(final, "a.bin") == b"x"

    other = backend.staging_dir(backend_root, 5, 0)  # another generation's unfinished write
    backend.write_file(other, "b.bin", b"y")
    assert backend.remove_stale(backend_root, current_generation=1) == [other]
    assert [stored.step for stored in backend.scan(backend_root)] == [3]
    backend.remove_checkpoint(final)
    assert list(backend.scan(backend_root)) == []
    assert list(backend.scan(f"{backend_root}-missing" if is_url(backend_root) else Path(f"{backend_root}-missing"))) == []


def test_a_commit_removes_its_generations_failed_checkpoints_of_earlier_steps(backend_root: Location) -> None:
    """Checkpoints of steps 15 and 20 failed part-way (a full disk) and left their partial files; the
    commit of step 25 by the same generation removes them, not a later generation's, not a later step's."""
    make_root(backend_root)
    backend = backend_for(backend_root)
    for step, generation in ((15, 2), (20, 2), (30, 2), (20, 3)):
        backend.write_file(staging_dir(backend_root, step, generation), "rank_0.pt", b"partial")
    staging = staging_dir(backend_root, 25, 2)
    records = [save_object(staging, rank_file(0), {"step": 25})]
    commit(backend_root, staging, step=25, generation=2, world_size=1, files=records)
    assert unfinished(backend_root) == {(30, 2), (20, 3)}
    assert [ckpt.step for ckpt in list_committed(backend_root)] == [25]


def unfinished(root: Location) -> set[tuple[int, int]]:
    """(step, generation) of every directory under ``root`` that is not a committed checkpoint."""
    if is_url(root):
        from undying.checkpoint.url_backend import UrlDir

        directory = UrlDir.open(root)
        return {ident for name in directory.children() if (ident := generation_dir_id(name))
                and not directory.fs.exists(directory.child(name).member(MANIFEST_NAME))}
    return {(int(match.group(1)), int(match.group(2))) for entry in Path(root).iterdir()
            if (match := PARTIAL_RE.fullmatch(entry.name))}
