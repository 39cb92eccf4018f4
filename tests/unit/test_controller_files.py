"""The run directory's record of a running job's controller, and its token file: mode 0600 from the
moment it exists, whatever the umask, and replacing any file already there."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from undying.launch.controller_files import (
    CONTROLLER_FILE,
    TOKEN_FILE,
    ControllerRecord,
    read_controller_record,
    remove_controller_files,
    write_controller_files,
    write_private,
)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o777])
def test_the_token_is_readable_by_its_owner_only(tmp_path: Path, umask: int):
    previous = os.umask(umask)
    try:
        write_controller_files(tmp_path, ControllerRecord("127.0.0.1:4000", "job", 42), "secret-token")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / TOKEN_FILE).stat().st_mode)
    assert mode == 0o600
    assert (tmp_path / TOKEN_FILE).read_text() == "secret-token\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no staging file left"


def test_the_token_is_created_private_not_narrowed_afterwards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The file is created with 0600 (never world-readable, even before a chmod)."""
    created = []
    real_open = os.open

    def recording_open(path, flags, mode=0o777, *args, **kwargs):
        created.append((Path(path).name, flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    write_private(tmp_path / TOKEN_FILE, "t")
    [(name, flags, mode)] = created
    assert name != TOKEN_FILE and flags & os.O_EXCL and flags & os.O_CREAT and mode == 0o600


def test_a_readable_file_in_the_way_is_replaced(tmp_path: Path):
    path = tmp_path / TOKEN_FILE
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, "new")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "new"


def test_the_record_round_trips_and_goes_at_the_end(tmp_path: Path):
    record = ControllerRecord("node0:29400", "3f2a", 1234, etcd="etcd-0:2379", job_name="llm")
    write_controller_files(tmp_path, record, "token")
    assert read_controller_record(tmp_path) == record
    remove_controller_files(tmp_path)
    assert not (tmp_path / CONTROLLER_FILE).exists() and not (tmp_path / TOKEN_FILE).exists()
    with pytest.raises(FileNotFoundError):
        read_controller_record(tmp_path)
