"""The in-process checks of ``scripts/gpu-check.sh``: one rank, one GPU, the runtime's own classes.

Runs standalone (no job, no agent), one check per invocation, from the repository root with
``PYTHONPATH=src``; prints one ``RESULT <check> PASS|FAIL <detail>`` line and exits 0 on PASS.
``--cpu`` runs what has a CPU meaning (the snapshot round trip, the optimizer state's placement)
and skips the NCCL checks.

    python scripts/gpu_check.py preflight|nccl-wait|nccl-timeout-abort|nccl-stuck-abort|snapshot|adam-placement|node-check [--cpu]
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GPU_SLEEP_CYCLES_PER_S = 1.5e9  # torch.cuda._sleep spins this many cycles a second, about (H200: ~1.98 GHz)
TIMEOUT_S = 3.0  # comm_timeout of the checks that must time out


def result(check: str, passed: bool, detail: str) -> int:
    print(f"RESULT {check} {'PASS' if passed else 'FAIL'} {detail}", flush=True)
    return 0 if passed else 1


def device() -> torch.device:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    return dev


def nccl_group(generation: int, timeout: float, dev: torch.device):  # noqa: ANN201 - a GenerationGroup
    from undying.runtime.pg import GenerationGroup

    return GenerationGroup(dist.HashStore(), "gpu-check", generation, 0, 1, "nccl", timeout, dev)


def queue_gpu_work(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds``: a collective queued now starts after it."""
    torch.cuda._sleep(int(seconds * GPU_SLEEP_CYCLES_PER_S))


def preflight(cpu: bool) -> int:
    import undying.config  # noqa: F401 - pydantic and PyYAML must be importable
    from undying.runtime.devices import choose_backend

    parts = [f"python={sys.version.split()[0]}", f"torch={torch.__version__}",
             f"cuda_available={torch.cuda.is_available()}"]
    if torch.cuda.is_available():
        parts += [f"gpu={torch.cuda.get_device_name(0)!r}", f"devices={torch.cuda.device_count()}",
                  f"cuda={torch.version.cuda}", f"nccl={'.'.join(map(str, torch.cuda.nccl.version()))}"]
    parts.append(f"auto_backend={choose_backend('auto', 1)}")
    return result("preflight", cpu or torch.cuda.is_available(), " ".join(parts))


def nccl_wait() -> int:
    """The bounded wait must wait for the GPU: a collective queued behind ~3 s of GPU work is not
    done when its future completes (at enqueue); ``_wait`` must return only once it is."""
    dev = device()
    group = nccl_group(1, 60.0, dev)
    tensor = torch.ones(1 << 20, device=dev)
    group.group.allreduce([tensor]).wait()  # world_size 1 short-circuits allreduce_sum: the backend's own call
    torch.cuda.synchronize()
    queue_gpu_work(3.0)
    work = group.group.allreduce([tensor])
    started = time.monotonic()
    group._wait("allreduce", work)
    waited = time.monotonic() - started
    completed = work.is_completed()
    value = tensor[:2].tolist()
    group.abandon()
    return result("nccl-wait", completed and waited > 1.0 and value == [1.0, 1.0],
                  f"waited={waited:.2f}s is_completed={completed} value={value}")


def nccl_timeout_abort(stuck: bool) -> int:
    """A collective that does not finish within comm_timeout: ``_wait`` raises after about comm_timeout,
    aborts the group, the process lives (no NCCL watchdog SIGABRT), and a next-generation group works.
    ``stuck``: a receive that nobody sends (a collective stuck in NCCL, as with a hung peer); else a
    collective queued behind GPU work longer than the timeout."""
    from undying.runtime.pg import CollectiveError

    check = "nccl-stuck-abort" if stuck else "nccl-timeout-abort"
    dev = device()
    group = nccl_group(1, TIMEOUT_S, dev)
    tensor = torch.ones(1 << 20, device=dev)
    group.group.allreduce([tensor]).wait()
    torch.cuda.synchronize()
    if stuck:
        work = group.group.recv([torch.empty(4, device=dev)], 0, 0)
    else:
        queue_gpu_work(4 * TIMEOUT_S)
        work = group.group.allreduce([tensor])
    started = time.monotonic()
    try:
        group._wait("allreduce", work)
        return result(check, False, f"_wait returned after {time.monotonic() - started:.2f}s (expected a timeout)")
    except CollectiveError as error:
        raised_after = time.monotonic() - started
        detail = f"raised_after={raised_after:.2f}s error={str(error)[:80]!r}"
    aborted = group._aborted
    group.abandon()
    began = time.monotonic()
    torch.cuda.current_stream().synchronize()
    drained = time.monotonic() - began
    next_group = nccl_group(2, 60.0, dev)
    fresh = torch.ones(8, device=dev)
    next_group.group.allreduce([fresh]).wait()
    torch.cuda.synchronize()
    next_ok = fresh[:2].tolist() == [1.0, 1.0]
    next_group.abandon()
    passed = raised_after < TIMEOUT_S + 2.0 and aborted and next_ok
    return result(check, passed, f"{detail} aborted={aborted} stream_drained_after={drained:.2f}s "
                                 f"next_generation_ok={next_ok}")


def snapshot(cpu: bool) -> int:
    """A T1 snapshot of a tensor whose update is still queued on the GPU when the snapshot is handed
    over (overlapped copy): the snapshot must hold the updated values; pages locked for the D2H copy."""
    from undying.checkpoint.snapshot import RankSnapshots

    dev = torch.device("cpu") if cpu else device()
    shm = os.environ.get("UNDYING_SHM_DIR", "/dev/shm" if Path("/dev/shm").is_dir() else None)
    snapshots = RankSnapshots(Path(tempfile.mkdtemp(prefix="undying-gpu-check-", dir=shm)), 0)
    try:
        params = torch.randn(16 << 20, device=dev)  # 64 MiB
        if not cpu:
            queue_gpu_work(2.0)
        params.mul_(2)  # on the GPU: queued behind the sleep when the snapshot starts
        started = time.monotonic()
        snapshots.write({"params": params}, step=1, generation=1, world_size=1, defer=lambda tensor: True)
        waited = snapshots.wait()
        same = torch.equal(snapshots.read(1)["params"], params.cpu())
        detail = (f"device={dev} equal={same} page_lock_error={snapshots.page_lock_error!r} "
                  f"wait={waited:.2f}s total={time.monotonic() - started:.2f}s")
        return result("snapshot", same and snapshots.page_lock_error is None, detail)
    finally:
        snapshots.close()


class LoopbackGroup:
    """Ranks of this process as threads, for runtime/state_transfer.py: send, recv and broadcast
    through queues. NCCL refuses two ranks on one GPU, and what is checked is where the received
    tensors land, which the backend does not decide."""

    def __init__(self, rank: int, world_size: int, channels: dict[tuple[int, int, int], queue.Queue],
                 lock: threading.Lock) -> None:
        self.rank, self.world_size, self._channels, self._lock = rank, world_size, channels, lock

    def _channel(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._channels.setdefault((src, dst, tag), queue.Queue())

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._channel(self.rank, dst, tag).put(tensor.clone())

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        tensor.copy_(self._channel(src, self.rank, tag).get(timeout=60))

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        if self.rank == root:
            for rank in range(self.world_size):
                if rank != root:
                    self.send(tensor, rank, -1)
        else:
            self.recv(tensor, root, -1)


def two_ranks(body: Any) -> list[Any]:
    """``body(group)`` on two LoopbackGroup ranks (threads); their results in rank order."""
    channels: dict[tuple[int, int, int], queue.Queue] = {}
    lock = threading.Lock()
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            results[index] = body(LoopbackGroup(index, 2, channels, lock))
        except BaseException as error:  # noqa: BLE001 - re-raised by the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return results


def trained_adamw(dev: torch.device, seed: int, capturable: bool, steps: int
                  ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=capturable)
    for _ in range(steps):
        model(torch.ones(4, 64, device=dev)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def adam_placement_case(dev: torch.device, capturable: bool) -> tuple[bool, list[str]]:
    """One AdamW (capturable or not) through the three paths; whether all passed, and how each went."""
    from undying.checkpoint.state_tree import copy_into
    from undying.runtime.state_transfer import broadcast_state, recv_state, send_state

    step_device = dev if capturable else torch.device("cpu")
    source_model, source_optimizer = trained_adamw(dev, 0, capturable, 2)
    sent = {"models": [source_model.state_dict()], "optimizers": [source_optimizer.state_dict()]}
    # As a storage load leaves it: every tensor in host memory.
    on_host = {"models": [{key: value.cpu() for key, value in sent["models"][0].items()}],
               "optimizers": [{"state": {index: {key: value.cpu() for key, value in entry.items()}
                                         for index, entry in sent["optimizers"][0]["state"].items()},
                               "param_groups": sent["optimizers"][0]["param_groups"]}]}
    receivers = {path: trained_adamw(dev, seed, capturable, 0)
                 for seed, path in enumerate(("repair", "t2-restore", "t1-restore"), start=1)}
    live = {path: {"models": [model.state_dict()], "optimizers": [optimizer.state_dict()]}
            for path, (model, optimizer) in receivers.items()}

    def repair(group: Any) -> Any:
        if group.rank == 0:
            return send_state(group, sent, [1], dev)
        return recv_state(group, 0, dev, live=live["repair"])

    def restore(group: Any) -> Any:
        return broadcast_state(group, on_host if group.rank == 0 else None, 0, dev,
                               live=live["t2-restore"] if group.rank else None)

    received = {"repair": two_ranks(repair)[1], "t2-restore": two_ranks(restore)[1],
                "t1-restore": copy_into(on_host, live["t1-restore"])}
    model_input = torch.ones(4, 64, device=dev)
    source_model(model_input).sum().backward()
    source_optimizer.step()
    passed, details = True, []
    for path, (model, optimizer) in receivers.items():
        model.load_state_dict(received[path]["models"][0])
        optimizer.load_state_dict(received[path]["optimizers"][0])
        entries = list(optimizer.state.values())
        placed = bool(entries) and all(entry["step"].device.type == step_device.type
                                       and entry["exp_avg"].device.type == dev.type
                                       and entry["exp_avg_sq"].device.type == dev.type for entry in entries)
        model(model_input).sum().backward()
        optimizer.step()
        same = all(torch.equal(a, b) for a, b in zip(source_model.parameters(), model.parameters(), strict=True))
        passed = passed and placed and same
        details.append(f"{path}{'-capturable' if capturable else ''}:placed={placed},next_step_equal={same}")
    return passed, details


def adam_placement(cpu: bool) -> int:
    """After a repair (send_state/recv_state), a T2 restore (broadcast_state of a host state) and a T1
    restore (copy_into from host memory), each loaded with the optimizer's own load_state_dict: an
    AdamW's ``step`` counters on the host and its moments on the GPU, as torch's AdamW keeps them
    (a capturable one, GPU only: everything on the GPU), and the next step equal to the source's."""
    dev = torch.device("cpu") if cpu else device()
    passed, details = adam_placement_case(dev, capturable=False)
    if not cpu:
        passed_capturable, details_capturable = adam_placement_case(dev, capturable=True)
        passed, details = passed and passed_capturable, details + details_capturable
    return result("adam-placement", passed, f"device={dev} " + " ".join(details))


def node_check(cpu: bool) -> int:
    """The device part of a node's health check (undying/agent/node_check.py) on this machine: the devices
    an NCCL rank would use are seen and compute a small matmul right (on CPU: gloo's CPU matmul)."""
    from undying.agent.node_check import device_check

    found = device_check(nproc=1, backend="gloo" if cpu else "nccl")
    passed = not found["problems"] and found["timings"]["devices"] == 1
    return result("node-check", passed, f"problems={found['problems']} timings={found['timings']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["preflight", "nccl-wait", "nccl-timeout-abort", "nccl-stuck-abort",
                                          "snapshot", "adam-placement", "node-check"])
    parser.add_argument("--cpu", action="store_true", help="no GPU: run the CPU meaning of the check, if any")
    args = parser.parse_args()
    if args.check == "preflight":
        return preflight(args.cpu)
    if args.check == "snapshot":
        return snapshot(args.cpu)
    if args.check == "adam-placement":
        return adam_placement(args.cpu)
    if args.check == "node-check":
        return node_check(args.cpu)
    if args.cpu:
        print(f"RESULT {args.check} SKIP needs a GPU and NCCL", flush=True)
        return 0
    if args.check == "nccl-wait":
        return nccl_wait()
    return nccl_timeout_abort(stuck=args.check == "nccl-stuck-abort")


if __name__ == "__main__":
    sys.exit(main())
