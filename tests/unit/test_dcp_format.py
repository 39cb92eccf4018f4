"""T2 format: the shared shard is a DCP checkpoint plain torch can load (from a local directory or
an fsspec URL); checksums guard it; the persister commits only complete checkpoints, even when it
is SIGKILLed mid-write."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fsspec.core import url_to_fs

from undying.checkpoint import (
    CorruptCheckpoint,
    Location,
    commit,
    latest_verified,
    list_committed,
    remove_stale_partials,
    staging_dir,
)
from undying.checkpoint.dcp_format import optimizer_param_names, read_shared_shard, write_shared_shard
from undying.checkpoint.persister import Persister
from undying.checkpoint.snapshot import RankSnapshots

REPO = Path(__file__).resolve().parents[2]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def replica_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int = 3) -> dict:
    return {"committed_step": step, "models": [model.state_dict()], "optimizers": [optimizer.state_dict()],
            "loaders": [{"epoch": 0, "position": 12, "seed": 0, "dataset_len": 64}], "statefuls": {}}


def write_checkpoint(root: Location, step: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer, Location]:
    model, optimizer = trained()
    staging = staging_dir(root, step, 1)
    records = write_shared_shard(staging, replica_state(model, optimizer, step),
                                 [optimizer_param_names(optimizer, [model])])
    committed = commit(root, staging, step=step, generation=1, world_size=1, files=records)
    return model, optimizer, committed.path


def test_shared_shard_round_trip(tmp_path: Path) -> None:
    model, optimizer, _ = write_checkpoint(tmp_path)
    loaded = read_shared_shard(latest_verified(tmp_path))
    assert loaded["committed_step"] == 3 and loaded["loaders"][0]["position"] == 12
    fresh = make_model()
    fresh.load_state_dict(loaded["models"][0])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh_optimizer.load_state_dict(loaded["optimizers"][0])
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor)
    expected, actual = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert actual["param_groups"] == expected["param_groups"]
    for param_id, per_param in expected["state"].items():
        for key, value in per_param.items():
            assert torch.equal(actual["state"][param_id][key], value)




@pytest.mark.parametrize("location", ["path", "file-url"])
def test_plain_torch_loads_the_checkpoint_without_undying(tmp_path: Path, location: str) -> None:
    """What docs/checkpoints.md tells a user to do, in a process that cannot import undying: with the
    directory's path, or (checkpoint.dir a URL) with its URL, which DCP reads through fsspec."""
    root = tmp_path / "ckpt" if location == "path" else f"file://{tmp_path}/ckpt"
    model, optimizer, path = write_checkpoint(root)
    assert isinstance(path, Path if location == "path" else str)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.path = [p for p in sys.path if "undying" not in p and "src" not in p.split("/")]
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        try:
            import undying  # noqa: F401
            raise SystemExit("undying must not be importable here")
        except ImportError:
            pass
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        state = {{"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}}
        dcp.load(state, checkpoint_id={str(path)!r})
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        for name, tensor in expected["model"].items():
            assert torch.equal(model.state_dict()[name], tensor), name
        for param_id, per_param in expected["optimizer"]["state"].items():
            for key, value in per_param.items():
                assert torch.equal(optimizer.state_dict()["state"][param_id][key], value), (param_id, key)
        print("loaded", len(expected["model"]), "tensors")
    """)
    # The venv's site-packages has undying installed (editable): run with -S and only torch's site dir.
    site = Path(torch.__file__).resolve().parents[1]
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, env=env,
                            timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loaded 4 tensors" in result.stdout


def test_checksum_mismatch_is_detected(tmp_path: Path) -> None:
    _, _, path = write_checkpoint(tmp_path, step=3)
    write_checkpoint(tmp_path, step=6)
    newest = tmp_path / "step_000000006" / "__0_0.distcp"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        read_shared_shard(list_committed(tmp_path)[0])
    skipped: list[str] = []
    assert latest_verified(tmp_path, on_corrupt=lambda p, reason: skipped.append(reason)).path == path
    assert skipped and "__0_0.distcp" in skipped[0]


def test_url_shared_shard_round_trip_and_checksums(url_root: str) -> None:
    """The shard under a URL root: written with DCP's fsspec writer, listed in the manifest,
    verified before it is read, and a flipped byte falls back to the previous checkpoint."""
    _, _, previous = write_checkpoint(url_root, step=3)
    model, _, path = write_checkpoint(url_root, step=6)
    assert path == f"{url_root}/step_000000006.g1"
    [newest, _] = list_committed(url_root)
    assert sorted(record.name for record in newest.manifest.files) == [".metadata", "__0_0.distcp"]
    loaded = read_shared_shard(newest)
    assert loaded["committed_step"] == 6
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["models"][0][name], tensor)

    fs, data_path = url_to_fs(f"{path}/__0_0.distcp")
    data = bytearray(fs.cat_file(data_path))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(data_path, bytes(data))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        read_shared_shard(newest)
    assert latest_verified(url_root, on_corrupt=lambda p, reason: None).path == previous


@pytest.mark.parametrize("root_kind", ["path", "url"])
def test_persister_commits_in_the_background(tmp_path: Path, url_root: str, root_kind: str) -> None:
    model, optimizer = trained()
    snapshots = RankSnapshots(tmp_path / "shm", rank=0)
    state = {"replica": replica_state(model, optimizer), "rank": {"rng": {"torch": torch.get_rng_state()},
                                                                  "statefuls": {}}}
    snapshots.write(state, step=3, generation=1, world_size=1)
    root = tmp_path / "ckpt" if root_kind == "path" else url_root
    persister = Persister(snapshots=snapshots, root=root, rank=0,
                          store=torch.distributed.HashStore(), key_prefix="t", keep=2,
                          param_names=[optimizer_param_names(optimizer, [model])], rank_file="rank_00000.pt",
                          records_timeout=30, current_generation=lambda: 1)
    persister.submit(3, 1, [0])
    persister.close(timeout=60)
    [result] = persister.results()
    assert result.committed and result.error is None, result
    [checkpoint] = list_committed(root)
    names = sorted(record.name for record in checkpoint.manifest.files)
    assert names == [".metadata", "__0_0.distcp", "rank_00000.pt"]
    assert read_shared_shard(checkpoint)["committed_step"] == 3


def test_persister_killed_mid_write_leaves_nothing_listed(tmp_path: Path) -> None:
    """SIGKILL inside the persister, after the shared shard's files are written, before the commit."""
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        from pathlib import Path
        from tests.unit.test_dcp_format import trained, replica_state, write_checkpoint
        from undying.checkpoint.dcp_format import optimizer_param_names
        from undying.checkpoint.persister import Persister
        from undying.checkpoint.snapshot import RankSnapshots
        root = Path({str(tmp_path / "ckpt")!r})
        write_checkpoint(root, step=2)
        model, optimizer = trained()
        snapshots = RankSnapshots(None, rank=0)
        snapshots.write({{"replica": replica_state(model, optimizer, 4), "rank": {{"rng": {{}}, "statefuls": {{}}}}}},
                        step=4, generation=1, world_size=1)
        persister = Persister(snapshots=snapshots, root=root, rank=0,
                              store=torch.distributed.HashStore(), key_prefix="t", keep=2,
                              param_names=[optimizer_param_names(optimizer, [model])], rank_file="rank_00000.pt",
                              records_timeout=30, current_generation=lambda: 1)
        persister.submit(4, 1, [0], fault=lambda: os.kill(os.getpid(), signal.SIGKILL))
        persister.flush()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                            cwd=REPO)
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    root = tmp_path / "ckpt"
    partial = root / "step_000000004.g1.partial"
    assert (partial / "__0_0.distcp").exists(), "the fault fires after the shard's data is on disk"
    assert [c.step for c in list_committed(root)] == [2]
    assert latest_verified(root).step == 2
    assert remove_stale_partials(root, current_generation=2) == [partial]
    manifest = json.loads((root / "step_000000002" / "MANIFEST.json").read_text())
    assert {f["name"] for f in manifest["files"]} == {".metadata", "__0_0.distcp"}
