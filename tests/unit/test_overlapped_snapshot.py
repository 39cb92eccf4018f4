"""Overlapped T1 snapshots in a real training loop: every snapshot holds exactly its committed step.

With ``checkpoint.overlap`` the parameters and AdamW state are copied on a helper thread while the
next step computes, and the wrapped optimizer's ``step()`` waits for that copy. If it did not, the
update would land in the middle of the copy and the snapshot would mix two steps. The loop runs in
a subprocess (a standalone one-rank job: ``undying.init()`` keeps one runtime per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

TRAIN = textwrap.dedent("""
    import json, time, torch, undying
    from undying.checkpoint import copy as copy_module
    from undying.checkpoint.copy import updated_only_by
    copy_now = copy_module.copy_now

    def slow_copy(views, tensors):  # the helper thread's copy, made slower than the step's compute:
        time.sleep(0.1)             # without the optimizer's wait, every update would race it
        copy_now(views, tensors)

    copy_module.copy_now = slow_copy
    rt = undying.init()
    torch.manual_seed(0)
    # 8M parameters + AdamW (96 MB), a forward and backward of a batch of 2.
    layers = [torch.nn.Linear(1024, 1024) for _ in range(8)]
    model = rt.wrap_model(torch.nn.Sequential(*layers, torch.nn.BatchNorm1d(1024)))
    opt = rt.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    engine = rt.checkpoints
    def state():
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    committed, pending = {0: state()}, []
    for step in rt.steps(12):
        with step:
            pending.append(engine.snapshots._background is not None)  # the last commit's copy may still run
            model(torch.randn(2, 1024)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            committed[int(step) + 1] = state()  # what the commit of this step snapshots
    engine.settle()
    deferrable = updated_only_by(rt.optimizers)
    held, mismatched = [], []
    for info in engine.snapshots.committed():
        snapshot = engine.snapshots.read(info.step)["replica"]["models"][0]
        held.append(info.step)
        for name, tensor in snapshot.items():
            if not torch.equal(tensor, committed[info.step][name]):
                mismatched.append(f"step {info.step}: {name}")
    print(json.dumps({"held": held, "mismatched": mismatched, "pending": pending,
                      "weight_deferred": deferrable(layers[0].weight),
                      "bn_stats_deferred": deferrable(model.module[8].running_mean),
                      "stall": engine.last_stall}))
""")


@pytest.mark.parametrize("overlap", [True, False])
def test_each_snapshot_holds_exactly_its_committed_step(tmp_path: os.PathLike, overlap: bool) -> None:
    spec = {"checkpoint": {"snapshot_slots": 4, "overlap": "on" if overlap else "auto", "interval": 1000}}
    env = {**os.environ, "UNDYING_SPEC": json.dumps(spec), "UNDYING_RUN_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", TRAIN], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["held"] == [12, 11, 10, 9]
    assert result["mismatched"] == []
    # Buffers change in the forward pass: always copied at the step boundary, never deferred.
    assert result["weight_deferred"] is True and result["bn_stats_deferred"] is False
    # Overlapped: at each step after the first, the previous commit's copy was still handed to the
    # helper thread when the step began (the optimizer step, not the boundary, waited for it).
    assert result["pending"] == ([False] + [True] * 11 if overlap else [False] * 12)
    assert result["stall"] > 0
