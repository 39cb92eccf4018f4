"""The GPT benchmark workload under TorchFT: replica groups that heal from a live peer.

Runs in each worker process of one replica group; bench/recovery.py starts the lighthouse and
one ``torchrun --max-restarts N`` per replica group (2 groups x 2 ranks). Within a group the
gradients are summed over torchrun's process group; across groups TorchFT's manager averages
them over the groups in the current quorum. A group that loses a rank is restarted whole by
its torchrun and fetches the live state from a peer group (TorchFT's HTTP transport) when it
rejoins. Logs JSON lines (starts, every step's commit, the kill) to ``$BENCH_LOG``.
Needs the ``bench`` extra (torchft); never imported by undying itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torchft

HERE = Path(__file__).resolve().parents[1] / "examples" / "gpt"
sys.path.insert(0, str(HERE))
from data import CharDataset  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def log(**record: object) -> None:
    line = {"time": time.time(), "group": int(os.environ["BENCH_REPLICA_GROUP"]), "rank": int(os.environ["RANK"]),
            "pid": os.getpid(), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **record}
    with open(os.environ["BENCH_LOG"], "a") as handle:
        handle.write(json.dumps(line) + "\n")


def wait_for_everyone(folder: Path, name: str, count: int) -> None:
    """Marks this rank ready in ``folder`` and waits until ``count`` ranks are."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).touch()
    while len(list(folder.iterdir())) < count:
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="replica groups a step needs to commit (TorchFT's min_replica_size)")
    parser.add_argument("--kill-group", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1, help="rank inside --kill-group")
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds: TorchFT's collective/commit timeout")
    parser.add_argument("--start-barrier", default=None,
                        help="a folder: the first start waits there for every rank of both groups, so the first "
                             "quorum holds both groups (the lighthouse forms one from whoever is heartbeating)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    replica_group = int(os.environ["BENCH_REPLICA_GROUP"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend, cross_group_pg = "nccl", torchft.ProcessGroupNCCL(timeout=timedelta(seconds=args.timeout))
    else:
        device = torch.device("cpu")
        backend, cross_group_pg = "gloo", torchft.ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    # torchrun's group: the gradient sum inside the replica group, and the TCPStore TorchFT's manager uses.
    dist.init_process_group(backend)
    group_rank, group_size = dist.get_rank(), dist.get_world_size()
    log(event="start")

    dataset = CharDataset((HERE / "input.txt").read_text(), 32)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=dataset.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=48)).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def load_state(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["opt"])

    manager = torchft.Manager(
        pg=cross_group_pg, min_replica_size=args.min_replicas,
        load_state_dict=load_state, state_dict=lambda: {"model": model.state_dict(), "opt": inner.state_dict()},
        replica_id=f"bench_{replica_group}", timeout=timedelta(seconds=args.timeout),
        # Every group seeds the model identically, so step 0 needs no weight broadcast.
        init_sync=False,
    )
    optimizer = torchft.Optimizer(manager, inner)
    if args.start_barrier and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        wait_for_everyone(Path(args.start_barrier), f"{replica_group}.{group_rank}", 2 * group_size)
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(dataset), generator=generator)
    global_rank = replica_group * group_size + group_rank
    world = 2 * group_size
    while (step := manager.current_step()) < args.steps:
        if (step == args.kill_step and replica_group == args.kill_group and group_rank == args.kill_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
            log(event="kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()  # also starts this step's quorum
        # The sample positions of the 4-rank job: a group that is out of the quorum skips its share.
        start = (step * world + global_rank) * 4
        batch = [dataset[int(i)] for i in order[start:start + 4]]
        x = torch.stack([b[0] for b in batch]).to(device)
        y = torch.stack([b[1] for b in batch]).to(device)
        _, loss = model(x, y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= group_size
        manager.allreduce(flat).wait()  # average over the groups in the quorum; errors only mark the step
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()  # steps the optimizer only if every group member votes to commit
        committed = manager.current_step() > step
        log(event="step", step=manager.current_step(), committed=committed,
            participants=manager.num_participants(), loss=round(loss.item(), 5))
    # Equal across all ranks when the groups stayed in step (a healed group included).
    log(event="done", step=manager.current_step(), param_sum=float(sum(p.detach().double().sum() for p in params)))
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
