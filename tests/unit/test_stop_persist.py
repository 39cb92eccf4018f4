"""A stop whose newest step is a checkpoint step waits for that step's periodic checkpoint instead
of writing it a second time into the same partial directory (where one rank's commit would pull the
directory from under another rank's second write: "FileNotFoundError ... rank_00003.pt.tmp").

The loop runs in a subprocess (a standalone one-rank job: ``undying.init()`` keeps one runtime per
process); the persister is slowed so that the periodic checkpoint is still being written when the
stop's ``persist_now`` comes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

TRAIN = textwrap.dedent("""
    import json, time, torch, undying
    from undying.checkpoint import persister as persister_module

    submitted = []
    submit = persister_module.Persister.submit
    def recording_submit(self, step, *args, **kwargs):
        submitted.append(step)
        return submit(self, step, *args, **kwargs)
    persister_module.Persister.submit = recording_submit
    write = persister_module.Persister._persist
    def slow_write(self, *args, **kwargs):  # the periodic write is in flight when the stop comes
        time.sleep(0.5)
        return write(self, *args, **kwargs)
    persister_module.Persister._persist = slow_write

    rt = undying.init()
    torch.manual_seed(0)
    model = rt.wrap_model(torch.nn.Linear(8, 8))
    opt = rt.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in rt.steps(10):
        with step:
            model(torch.randn(2, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    rt.checkpoints.persist_now(10)  # what a stop's plan asks of every rank at step 10
    print(json.dumps({"submitted": submitted,
                      "committed": [c.step for c in rt.checkpoints.root.list_committed()]}))
""")


def test_a_stop_on_a_checkpoint_step_waits_for_its_periodic_checkpoint(tmp_path: os.PathLike) -> None:
    spec = {"checkpoint": {"interval": 5, "snapshot_interval": 1}}
    env = {**os.environ, "UNDYING_SPEC": json.dumps(spec), "UNDYING_RUN_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", TRAIN], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["submitted"] == [5, 10], result  # step 10 written once, by its periodic checkpoint
    assert result["committed"][0] == 10, result  # and durable when persist_now returns
