"""A checkpoint root is bound to one storage backend when it is built: every operation on it, the
DCP writer and reader of its checkpoints included, goes to that backend and no other is looked up;
no worker-side module outside the backends asks whether a location is a URL."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import undying.checkpoint.root as root_module
from tests.unit.test_dcp_format import replica_state, trained
from undying.checkpoint import CheckpointRoot, Location, list_committed
from undying.checkpoint.backend import StorageBackend
from undying.checkpoint.backends import backend_for
from undying.checkpoint.dcp_format import optimizer_param_names, read_shared_shard, write_shared_shard
from undying.checkpoint.local_backend import LocalBackend
from undying.checkpoint.url_backend import UrlBackend

SRC = Path(__file__).resolve().parents[2] / "src" / "undying"


class CountingBackend:
    """A real backend (``inner``) that counts the calls it serves, to show which backend a root used."""

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner
        self.kernel_writeback = inner.kernel_writeback
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


@pytest.fixture(params=["local", "url"])
def location(request: pytest.FixtureRequest, tmp_path: Path, url_root: str) -> Location:
    return tmp_path / "ckpt" if request.param == "local" else url_root


def test_a_root_is_bound_to_the_backend_its_location_picks(location: Location) -> None:
    root = CheckpointRoot.at(str(location))
    assert type(root.backend) is (UrlBackend if isinstance(location, str) else LocalBackend)
    assert root.location == location  # a path given as a string becomes a Path; a URL stays as given
    assert CheckpointRoot.of(root) is root
    assert str(root) == str(location)


def test_every_operation_goes_to_the_bound_backend_and_none_is_looked_up(
        location: Location, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = CountingBackend(backend_for(location))
    root = CheckpointRoot(location, backend)

    def no_lookup(where: object) -> StorageBackend:
        raise AssertionError(f"backend looked up again for {where}")

    monkeypatch.setattr(root_module, "backend_for", no_lookup)
    model, optimizer = trained()
    root.make()
    staging = root.staging_dir(3, 1)
    records = write_shared_shard(staging, replica_state(model, optimizer, 3),
                                 [optimizer_param_names(optimizer, [model])], root)
    records.append(root.save_object(staging, "rank_00000.pt", {"rng": torch.get_rng_state()}))
    committed = root.commit(staging, step=3, generation=1, world_size=1, files=records, keep=1)
    assert committed.backend is backend
    [listed] = root.list_committed()
    assert listed.backend is backend and listed.path == committed.path
    assert root.latest_verified() is not None
    loaded = read_shared_shard(listed)
    assert loaded["committed_step"] == 3
    assert torch.equal(loaded["models"][0]["0.weight"], model.state_dict()["0.weight"])

    # The DCP writer and reader came from the bound backend, and so did every file operation.
    assert backend.calls["dcp_writer"] == 1 and backend.calls["dcp_reader"] == 1
    for operation in ("make_root", "staging_dir", "write_file", "check_staging", "publish", "scan",
                      "file_size", "file_checksum", "remove_abandoned"):
        assert backend.calls[operation] >= 1, operation
    monkeypatch.undo()
    assert [c.step for c in list_committed(location)] == [3]  # what another process would find there


def test_no_worker_module_outside_the_backends_asks_whether_a_location_is_a_url() -> None:
    """Whether a location is a URL decides its backend, once, in the backend modules; the checkpoint
    code and the worker runtime ask the backend instead."""
    backend_modules = {"backend.py", "backends.py", "local_backend.py", "url_backend.py"}
    offenders = []
    for package in ("checkpoint", "runtime"):
        for module in sorted((SRC / package).rglob("*.py")):
            if package == "checkpoint" and module.name in backend_modules:
                continue
            for number, line in enumerate(module.read_text().splitlines(), 1):
                if re.search(r"\bis_url\(|\"://\" in ", line):
                    offenders.append(f"{module.relative_to(SRC)}:{number}: {line.strip()}")
    assert offenders == []
