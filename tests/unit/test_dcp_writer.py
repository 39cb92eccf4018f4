"""T2's DCP writer (checkpoint/dcp_writer.py): each file's size and CRC-32 come from the bytes as they
were written, never from reading the file back, and they match what the storage holds; the shard may
span several files written in parallel, which plain DCP loads and the manifest still guards; a writer
killed mid-file leaves no checkpoint."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap
import threading
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs

from undying.checkpoint import (
    CorruptCheckpoint,
    Location,
    commit,
    dcp_writer,
    latest_verified,
    list_committed,
    staging_dir,
)
from undying.checkpoint.dcp_format import optimizer_param_names, read_shared_shard, write_shared_shard
from undying.checkpoint.local_backend import LocalBackend
from undying.checkpoint.url_backend import UrlBackend

REPO = Path(__file__).resolve().parents[2]


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def write(root: Location, step: int) -> tuple[torch.nn.Module, Location]:
    model, optimizer = trained()
    staging = staging_dir(root, step, 1)
    replica = {"committed_step": step, "models": [model.state_dict()], "optimizers": [optimizer.state_dict()],
               "loaders": [{"epoch": 0, "position": 5, "seed": 0, "dataset_len": 64}], "statefuls": {}}
    records = write_shared_shard(staging, replica, [optimizer_param_names(optimizer, [model])])
    return model, commit(root, staging, step=step, generation=1, world_size=1, files=records).path


def stored_bytes(directory: Location, name: str) -> bytes:
    if isinstance(directory, Path):
        return (directory / name).read_bytes()
    fs, path = url_to_fs(f"{directory}/{name}")
    return bytes(fs.cat_file(path))


@pytest.fixture
def two_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every state counts as large: the shard is written by two threads into two data files."""
    monkeypatch.setattr(dcp_writer, "PARALLEL_WRITE_BYTES", 0)


@pytest.mark.parametrize("root_kind", ["path", "url"])
@pytest.mark.parametrize("threads", [1, 2])
def test_records_are_the_written_bytes_and_nothing_is_read_back(
        tmp_path: Path, url_root: str, monkeypatch: pytest.MonkeyPatch, root_kind: str, threads: int) -> None:
    root: Location = tmp_path / "ckpt" if root_kind == "path" else url_root
    monkeypatch.setattr(dcp_writer, "PARALLEL_WRITE_BYTES", 0 if threads == 2 else 1 << 40)

    def no_read_back(*_: object) -> None:
        raise AssertionError("a file was read back for its checksum")

    with monkeypatch.context() as reading:
        reading.setattr(LocalBackend, "file_checksum", no_read_back)
        reading.setattr(UrlBackend, "file_checksum", no_read_back)
        model, path = write(root, step=4)
    [checkpoint] = list_committed(root)
    data_files = sorted(record.name for record in checkpoint.manifest.files if record.name.endswith(".distcp"))
    assert len(data_files) == threads, data_files
    for record in checkpoint.manifest.files:
        data = stored_bytes(path, record.name)
        assert (len(data), f"crc32:{zlib.crc32(data):08x}") == (record.size, record.checksum), record.name
    # Plain DCP, reading every data file, puts the weights back.
    loaded = {name: torch.zeros_like(tensor) for name, tensor in model.state_dict().items()}
    dcp.load({"model": loaded}, checkpoint_id=str(path))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in model.state_dict().items())
    assert read_shared_shard(checkpoint)["loaders"][0]["position"] == 5


def record_crcs(data: bytes) -> list[int]:
    """The CRC-32 of each record of the ``torch.save`` archives in ``data``, from the archives' central
    directories (0: left out)."""
    crcs, at = [], 0
    while (at := data.find(b"PK\x01\x02", at)) >= 0:
        crcs.append(int.from_bytes(data[at + 16:at + 20], "little"))
        at += 4
    return crcs


def test_torch_leaves_out_its_record_crcs_only_inside_a_checksummed_stream(tmp_path: Path, two_files: None) -> None:
    """T2's data files carry one CRC-32 each (the manifest's): ``torch.save`` computes none of its own
    for the records it writes into them, while a save on another thread at the same time, and any
    save afterwards, keeps its records' CRCs; the process-wide option is never switched."""
    plain = tmp_path / "plain.pt"
    saving = threading.Event()
    inside: list[bool] = []
    real_write = dcp_writer._ChecksummingStream.write

    def write_and_save_beside(self: object, data: object) -> int:
        if not saving.is_set():  # a training thread's torch.save while the shard is being written
            saving.set()
            other = threading.Thread(target=torch.save, args=(torch.arange(100.0), plain))
            other.start()
            other.join()
            inside.append(torch.serialization.get_crc32_options())
        return real_write(self, data)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dcp_writer._ChecksummingStream, "write", write_and_save_beside)
        _, path = write(tmp_path / "ckpt", step=4)
    assert isinstance(path, Path)
    assert inside == [False]  # the writing thread saw its own answer ...
    assert torch.serialization.get_crc32_options()  # ... and nobody else did
    assert all(record_crcs(plain.read_bytes()))  # the other thread's records kept theirs
    data = b"".join((path / name).read_bytes() for name in ("__0_0.distcp", "__0_1.distcp"))
    assert record_crcs(data) and not any(record_crcs(data))
    torch.save(torch.arange(100.0), tmp_path / "after.pt")
    assert all(record_crcs((tmp_path / "after.pt").read_bytes()))


def test_a_flipped_byte_in_the_second_data_file_is_caught_before_load(tmp_path: Path, two_files: None) -> None:
    write(tmp_path, step=2)
    _, path = write(tmp_path, step=4)
    assert isinstance(path, Path)
    second = path / "__0_1.distcp"
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0x01
    second.write_bytes(bytes(data))
    newest = list_committed(tmp_path)[0]
    with pytest.raises(CorruptCheckpoint, match="__0_1.distcp: checksum"):
        read_shared_shard(newest)
    skipped: list[str] = []
    assert latest_verified(tmp_path, on_corrupt=lambda _, reason: skipped.append(reason)).step == 2
    assert len(skipped) == 1 and "__0_1.distcp" in skipped[0]


def test_a_writer_killed_mid_file_leaves_no_checkpoint(tmp_path: Path) -> None:
    """SIGKILL in the middle of a data file, once a few KiB of it are written."""
    root = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from tests.unit.test_dcp_writer import write
        from undying.checkpoint import dcp_writer
        write(Path({str(root)!r}), step=2)
        original = dcp_writer._ChecksummingStream.write
        def write_then_die(self, data):
            written = original(self, data)
            if self.size > 4096:
                os.kill(os.getpid(), signal.SIGKILL)
            return written
        dcp_writer._ChecksummingStream.write = write_then_die
        write(Path({str(root)!r}), step=4)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    partial = root / "step_000000004.g1.partial"
    complete = (root / "step_000000002" / "__0_0.distcp").stat().st_size
    assert (partial / "__0_0.distcp").stat().st_size < complete, "killed with part of the data file written"
    assert not (partial / ".metadata").exists()
    assert [checkpoint.step for checkpoint in list_committed(root)] == [2]
    assert latest_verified(root).step == 2


def test_writeback_is_started_over_the_whole_file_as_it_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    starter = dcp_writer._writeback_starter()
    if starter is None:
        pytest.skip("no sync_file_range on this platform")
    kicks: list[tuple[int, int]] = []

    def recording_starter() -> object:
        def start(fd: int, offset: int, nbytes: int) -> None:
            kicks.append((offset, nbytes))
            starter(fd, offset, nbytes)
        return start

    monkeypatch.setattr(dcp_writer, "WRITEBACK_BYTES", 4096)
    monkeypatch.setattr(dcp_writer, "_writeback_starter", recording_starter)
    _, path = write(tmp_path, step=4)
    assert isinstance(path, Path)
    runs: list[list[tuple[int, int]]] = []  # one per file written: its kicks start at offset 0
    for offset, nbytes in kicks:
        if offset == 0:
            runs.append([])
        runs[-1].append((offset, nbytes))
    data_run = runs[0]  # the data file is written before .metadata
    size = (path / "__0_0.distcp").stat().st_size
    assert len(data_run) > 1
    assert all(offset == previous + nbytes
               for (previous, nbytes), (offset, _) in zip(data_run, data_run[1:], strict=False))
    assert size - 4096 < data_run[-1][0] + data_run[-1][1] <= size
    assert latest_verified(tmp_path).step == 4  # the bytes are intact


def test_stream_refuses_a_short_write_and_other_modes(tmp_path: Path) -> None:
    class ShortWriter(io.BytesIO):
        def write(self, data: object) -> int:
            return super().write(data) - 1  # type: ignore[arg-type]

    stream = dcp_writer._ChecksummingStream(ShortWriter(), None)
    with pytest.raises(OSError, match="short write"):
        stream.write(b"0123456789")
    files = dcp_writer.ChecksummingFileSystem(dcp_filesystem())
    with pytest.raises(ValueError, match="'rb' or 'wb'"), files.create_stream(tmp_path / "x", "ab"):
        pass


def test_records_follow_a_rename_and_exist_only_for_completed_files(tmp_path: Path) -> None:
    files = dcp_writer.ChecksummingFileSystem(dcp_filesystem())
    with files.create_stream(tmp_path / ".metadata.tmp", "wb") as stream:
        stream.write(b"abc")
        stream.write(memoryview(torch.arange(4, dtype=torch.int32).numpy()))
    files.rename(tmp_path / ".metadata.tmp", tmp_path / ".metadata")
    data = (tmp_path / ".metadata").read_bytes()
    assert files.written(".metadata") == (len(data), f"crc32:{zlib.crc32(data):08x}")
    assert files.written(".metadata.tmp") is None
    with pytest.raises(RuntimeError), files.create_stream(tmp_path / "torn", "wb") as stream:
        stream.write(b"partial")
        raise RuntimeError("the writer failed midway")
    assert files.written("torn") is None


def dcp_filesystem() -> object:
    """DCP's own local filesystem, the one its writer would use."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    return FileSystem()


def test_a_failing_writer_thread_fails_the_shard_instead_of_dropping_its_file(
        tmp_path: Path, two_files: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's second writer thread ends on an error without raising it in the caller: the shard must
    still fail, not commit a checkpoint whose ``.metadata`` lacks that thread's tensors."""
    original = dcp_writer._ChecksummingStream.write

    def disk_full_off_the_main_thread(self: object, data: object) -> int:
        if threading.current_thread() is not threading.main_thread():
            raise OSError(28, "No space left on device")
        return original(self, data)  # type: ignore[arg-type]

    monkeypatch.setattr(dcp_writer._ChecksummingStream, "write", disk_full_off_the_main_thread)
    with pytest.raises(OSError, match="of .* items|No space left"):
        write(tmp_path, step=4)
    assert list_committed(tmp_path) == []
