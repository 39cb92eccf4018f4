"""Feasibility experiment for sharded models (FSDP2 / HSDP) under in-place recovery: can the
``fully_shard``-ed model keep its DeviceMesh while the process groups under it are replaced by a
new generation's, and does a replacement rank that receives its shard from its replica peer end
bitwise where an uninterrupted run ends?

Spawns 4 gloo processes on 127.0.0.1 forming a 2 x 2 (replicate, shard) DeviceMesh built with
``DeviceMesh.from_group`` over ``SwappableGroup``s: torch ``ProcessGroup`` subclasses whose
collectives go to a per-generation gloo group (on ``PrefixStore(f"gen{g}/...")``) and whose works
are waited with a bounded, abortable wait. Not product code: the design note is docs/sharding.md.

Modes (each prints one JSON line on stdout; ``--out`` also writes it):

    # 1. fault: rank 3 SIGKILLs itself before step 4, a fresh process takes rank 3 in generation 2,
    #    survivors swap backends without re-applying fully_shard; compared with an uninterrupted run
    python bench/studies/sharded_regroup.py regroup --fault kill --steps 8 --fault-step 4
    # ... without dropping the failed step's unsharded gradients: not bitwise equal (see docs/sharding.md)
    python bench/studies/sharded_regroup.py regroup --fault kill --no-clear-unsharded-grads
    # ... the same with a hung peer (SIGSTOP): survivors must give up within --comm-timeout
    python bench/studies/sharded_regroup.py regroup --fault hang --steps 8 --fault-step 4 --comm-timeout 5
    # 2. determinism: the same step replayed from the same state, 10 times
    python bench/studies/sharded_regroup.py replay --replays 10
    # 4. step time: swappable groups against stock init_device_mesh groups, interleaved
    python bench/studies/sharded_regroup.py bench --steps 40

Runs in its own processes (a parent and 4 workers); imports examples/gpt/model.py.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from undying.runtime.mesh import forward_collectives  # the methods FSDP2/HSDP/DTensor call on a group

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
REPLICATE, SHARD = 2, 2  # mesh [[0, 1], [2, 3]]: rows are replicas, columns are shard indices
ABORT_POLL_S = 0.05
BUILD_TIMEOUT = datetime.timedelta(seconds=120)  # a group's rendezvous waits for a cold newcomer



class CollectiveError(RuntimeError):
    """A collective of a SwappableGroup failed, timed out or was aborted."""


class BoundedWork(dist.Work):
    """A work of one generation, waited without blocking past comm_timeout or an abort. Once its
    generation is retired, ``wait`` returns at once: FSDP's ``reset_iter_state`` waits on the
    failed step's pending all-gather, whose result is discarded anyway."""

    def __init__(self, inner: dist.Work, group: SwappableGroup, op: str) -> None:
        super().__init__()
        self.inner, self.group, self.op = inner, group, op
        self.generation = group.generation

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.generation != self.group.generation:
            return False
        finished = threading.Event()
        failure: list[BaseException] = []
        waited_by_helper = False
        try:
            self.inner.get_future().add_done_callback(lambda _: finished.set())
        except RuntimeError:  # gloo send/recv have no future: block on a helper thread instead
            waited_by_helper = True
            threading.Thread(target=_blocking_wait, args=(self.inner, finished, failure), daemon=True).start()
        started = time.monotonic()
        while not finished.wait(ABORT_POLL_S):
            if self.group.should_abort():
                self.group.record_failure(self.op, "abort", time.monotonic() - started)
                raise CollectiveError(f"{self.op} on {self.group.group_name}: generation aborted")
            if time.monotonic() - started > self.group.comm_timeout_s:
                self.group.record_failure(self.op, "timeout", time.monotonic() - started)
                raise CollectiveError(f"{self.op} on {self.group.group_name}: no completion within "
                                      f"{self.group.comm_timeout_s:g} s")
        try:
            if failure:
                raise failure[0]
            if not waited_by_helper:  # a gloo send/recv work must not be waited twice: it would block
                self.inner.wait()  # already complete: returns, or raises the collective's own error
        except CollectiveError:
            raise
        except Exception as error:
            self.group.record_failure(self.op, "error", time.monotonic() - started)
            raise CollectiveError(f"{self.op} on {self.group.group_name}: {error}") from None
        return True

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self.inner.get_future()


def _blocking_wait(work: dist.Work, finished: threading.Event, failure: list[BaseException]) -> None:
    try:
        work.wait()
    except Exception as error:  # noqa: BLE001 - handed to the waiting thread
        failure.append(error)
    finally:
        finished.set()


class SwappableGroup(dist.ProcessGroup):
    """A ProcessGroup whose identity (object, name, rank, size) outlives generations: FSDP2 and the
    DeviceMesh hold this object; ``swap`` points it at a new generation's stock group."""

    def __init__(self, name: str, rank: int, size: int, comm_timeout_s: float,
                 should_abort: Callable[[], bool]) -> None:
        super().__init__(rank, size)
        self._name = name
        self.comm_timeout_s = comm_timeout_s
        self.should_abort = should_abort
        self.generation = 0
        self.current: dist.ProcessGroup | None = None
        self.retired: list[dist.ProcessGroup] = []  # a dead generation's destructor may block: never run it here
        self.calls: collections.Counter[str] = collections.Counter()
        self.members: list[int] = []  # global ranks, in group-rank order
        self.failures: list[dict[str, Any]] = []

    def swap(self, store: dist.Store, generation: int) -> None:
        """Retire the current generation's group and build the next one's (blocks until every member
        of this group has joined)."""
        if self.current is not None:
            self.retired.append(self.current)
        self.generation = generation
        prefixed = dist.PrefixStore(f"gen{generation}/{self.group_name}", store)
        inner = dist.ProcessGroup(prefixed, self.rank(), self.size())
        inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        gloo = dist.ProcessGroupGloo(prefixed, self.rank(), self.size(), BUILD_TIMEOUT)
        inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        inner._set_group_name(f"{self._name}/gen{generation}")
        self.current = inner

    @property
    def group_name(self) -> str:  # type: ignore[override]
        # torch's own property asks the backend, which this object has none of.
        return self._name

    def retire(self, generation: int) -> None:
        """Mark the generation over: its pending works stop waiting (see BoundedWork)."""
        self.generation = generation

    def record_failure(self, op: str, reason: str, waited_s: float) -> None:
        self.failures.append({"group": self.group_name, "op": op, "reason": reason, "waited_s": round(waited_s, 3),
                              "at": time.monotonic()})

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "undying-swappable"

    def _forward(self, op: str, *args: Any) -> dist.Work:
        self.calls[op] += 1
        assert self.current is not None, f"{self.group_name}: no generation built"
        return BoundedWork(getattr(self.current, op)(*args), self, op)


forward_collectives(SwappableGroup)


# ---------------------------------------------------------------- worker side


def log(rank: int, message: str) -> None:
    print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)


def register(group: SwappableGroup, store: dist.Store) -> None:
    """Make ``group`` known to torch the way ``new_group`` would: by name (DeviceMesh, DTensor's
    functional collectives) and in ``_world`` (``get_backend``, ``get_process_group_ranks``,
    c10d's logging of a failed collective). Emptied by ``destroy_process_group()``, so it is redone
    after every rebuild of the default group."""
    distributed_c10d._register_process_group(group.group_name, group)
    world = distributed_c10d._world
    world.pg_map[group] = ("gloo", store)
    world.pg_group_ranks[group] = {global_rank: group_rank for group_rank, global_rank in enumerate(group.members)}
    world.pg_to_tag[group] = f"undying:{group.group_name}"
    world.tags_to_pg.setdefault(f"undying:{group.group_name}", []).append(group)


class Generation:
    """The per-process distributed state of one rank: its default group (rebuilt per generation, as
    undying's DefaultGroup is) and its two mesh groups (swapped, never rebuilt)."""

    def __init__(self, rank: int, store: dist.Store, comm_timeout_s: float, aborts: list[Any]) -> None:
        self.rank, self.store, self.generation = rank, store, 0
        self.aborts = aborts
        row, column = divmod(rank, SHARD)

        def should_abort() -> bool:
            return bool(self.aborts[self.generation].is_set())
        self.replicate = SwappableGroup(f"replicate{column}", row, REPLICATE, comm_timeout_s, should_abort)
        self.replicate.members = [column + SHARD * r for r in range(REPLICATE)]
        self.shard = SwappableGroup(f"shard{row}", column, SHARD, comm_timeout_s, should_abort)
        self.shard.members = [row * SHARD + c for c in range(SHARD)]
        self.retired_defaults: list[Any] = []

    def enter(self, generation: int) -> None:
        """Leave the current generation (if any) and build ``generation``'s groups."""
        for group in (self.replicate, self.shard):
            group.retire(generation)
        self.generation = generation
        if dist.is_initialized():
            # As undying's DefaultGroup.drop: forget without shutting down, which would wait on a dead peer.
            names = distributed_c10d._world.pg_names
            self.retired_defaults.extend(names)
            names.clear()
            dist.destroy_process_group()  # also empties torch's name registry: the mesh groups go too
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{generation}/default", self.store),
                                rank=self.rank, world_size=WORLD, timeout=BUILD_TIMEOUT)
        for group in (self.replicate, self.shard):  # every rank builds replicate first: no cycle
            group.swap(self.store, generation)
            register(group, self.store)

    def mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh
        layout = torch.arange(WORLD).view(REPLICATE, SHARD)
        return DeviceMesh.from_group([self.replicate, self.shard], "cpu", mesh=layout,
                                     mesh_dim_names=("replicate", "shard"))

    def calls(self) -> dict[str, int]:
        return dict(self.replicate.calls + self.shard.calls)


def build_model(args: argparse.Namespace, mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    sys.path.insert(0, str(REPO / "examples" / "gpt"))
    from model import GPT, GPTConfig
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=args.block_size, n_layer=args.n_layer, n_head=2,
                          n_embd=args.n_embd))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def batch(args: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Each replica row sees its own data; both shard ranks of a row see the same batch, as in HSDP.
    generator = torch.Generator().manual_seed(1000 * step + rank // SHARD)
    tokens = torch.randint(0, 65, (args.batch, args.block_size + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
               step: int, rank: int) -> float:
    inputs, targets = batch(args, step, rank)
    _, loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shard of every parameter and optimizer-state tensor, in a fixed order that a
    replica peer (same shard index) has too."""
    tensors = []
    for param in model.parameters():
        tensors.append(param.to_local())
        state = optimizer.state[param]
        for key in sorted(state):
            value = state[key]
            tensors.append(value.to_local() if hasattr(value, "to_local") else value)
    return tensors


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters and optimizer state; a collective over the mesh."""
    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        full[name] = param.full_tensor()
        for key, value in sorted(optimizer.state[param].items()):
            full[f"{name}/{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    return full


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def digest(state: dict[str, torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for name in sorted(state):
        sha.update(name.encode())
        sha.update(raw_bytes(state[name]).numpy().tobytes())
    return sha.hexdigest()[:16]


def transfer_shard(gen: Generation, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   lost_rank: int, role: str) -> float:
    """The replica peer holding the lost rank's shard sends it (params + optimizer state) over the
    column's replicate group, tensor by tensor. Returns the seconds it took."""
    started = time.monotonic()
    peer_row = 1 - lost_rank // SHARD  # the other replica of the same column (REPLICATE == 2)
    for tag, tensor in enumerate(local_state(model, optimizer)):
        if role == "donor":
            gen.replicate.send([tensor.contiguous()], 1 - peer_row, tag).wait()
        else:
            received = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            gen.replicate.recv([received], peer_row, tag).wait()
            with torch.no_grad():
                tensor.copy_(received)
    return time.monotonic() - started


def local_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    return digest({str(i): t for i, t in enumerate(local_state(model, optimizer))})


def clear_unsharded_grads(model: torch.nn.Module) -> None:
    """Drop the gradients a failed backward left on FSDP's unsharded parameters (torch 2.13's
    ``reset_iter_state`` keeps them; autograd would add the replayed step's gradients to them)."""
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        for group in (state()._fsdp_param_groups if state else []):
            for fsdp_param in group.fsdp_params:
                fsdp_param._unsharded_param.grad = None
                fsdp_param.unsharded_accumulated_grad = None


def init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily made state (any torch optimizer) by one step on zero gradients;
    every value is then overwritten by the transfer."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def regroup_worker(rank: int, args: argparse.Namespace, port: int, queue: Any, aborts: list[Any],
                   start_generation: int, start_step: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=BUILD_TIMEOUT)
    gen = Generation(rank, store, args.comm_timeout, aborts)
    gen.enter(start_generation)
    model, optimizer = build_model(args, gen.mesh())
    newcomer = start_generation > 1
    if newcomer:
        init_optimizer_state(model, optimizer)
        seconds = transfer_shard(gen, model, optimizer, rank, "receiver")
        queue.put({"event": "received", "rank": rank, "seconds": seconds, "local": local_digest(model, optimizer)})
    step = start_step
    losses: dict[int, float] = {}
    while step < args.steps:
        if args.fault != "none" and start_generation == 1 and rank == args.victim and step == args.fault_step:
            store.set("fault_at", repr(time.monotonic()))
            log(rank, f"fault '{args.fault}' before step {step}")
            os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
        try:
            losses[step] = train_step(model, optimizer, args, step, rank)
            step += 1
        except CollectiveError as error:
            failed_at = time.monotonic()
            fault_at = float(store.get("fault_at"))
            log(rank, f"step {step} failed after {failed_at - fault_at:.3f} s: {error}")
            queue.put({"event": "failed", "rank": rank, "step": step, "after_fault_s": round(failed_at - fault_at, 3),
                       "reason": (gen.replicate.failures + gen.shard.failures)[-1]["reason"], "error": str(error)})
            started = time.monotonic()
            # The mesh groups are retired before the reset: it waits on the failed all-gather's work.
            gen.enter(gen.generation + 1)
            model.reset_iter_state()
            optimizer.zero_grad(set_to_none=True)
            if args.clear_unsharded_grads:
                clear_unsharded_grads(model)
            if rank + SHARD == args.victim or rank - SHARD == args.victim:
                transfer_shard(gen, model, optimizer, args.victim, "donor")
                queue.put({"event": "donated", "rank": rank, "local": local_digest(model, optimizer)})
            queue.put({"event": "regrouped", "rank": rank, "seconds": round(time.monotonic() - started, 3)})
    full = full_state(model, optimizer)
    queue.put({"event": "done", "rank": rank, "digest": digest(full), "calls": gen.calls(), "losses": losses})
    if rank == 0:
        torch.save(full, Path(args.scratch) / f"{args.label}.pt")
    finish(queue)


def run_regroup(args: argparse.Namespace, fault: str, label: str) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=BUILD_TIMEOUT)
    queue = ctx.Queue()
    aborts = [ctx.Event() for _ in range(4)]
    run_args = argparse.Namespace(**{**vars(args), "fault": fault, "label": label})
    procs = {rank: ctx.Process(target=regroup_worker, args=(rank, run_args, store.port, queue, aborts, 1, 0))
             for rank in range(WORLD)}
    for proc in procs.values():
        proc.start()
    events: list[dict[str, Any]] = []
    replaced = False
    deadline = time.monotonic() + args.run_timeout
    while sum(1 for e in events if e["event"] == "done") < WORLD:
        if time.monotonic() > deadline:
            for proc in procs.values():
                proc.kill()
            raise RuntimeError(f"{label}: no result within {args.run_timeout} s; events {events}")
        victim = procs[args.victim]
        crashed = [rank for rank, proc in procs.items() if proc.exitcode not in (None, 0) and rank != args.victim]
        if crashed:
            for proc in procs.values():
                proc.kill()
            raise RuntimeError(f"{label}: ranks {crashed} crashed; events {events}")
        victim_gone = fault == "kill" and not victim.is_alive()
        try:
            event = queue.get(timeout=0.05)
            events.append(event)
        except Exception:  # noqa: BLE001 - queue.Empty
            event = None
        hang_seen = fault == "hang" and event is not None and event["event"] == "failed"
        if not replaced and (victim_gone or hang_seen):
            # What undying's controller does: abort the generation, replace the rank, start generation 2.
            aborts[1].set()
            victim.kill()
            victim.join()
            procs[args.victim] = ctx.Process(target=regroup_worker, args=(args.victim, run_args, store.port, queue,
                                                                          aborts, 2, args.fault_step))
            procs[args.victim].start()
            replaced = True
    for proc in procs.values():
        proc.join(timeout=30)
    return events


def finish(queue: Any) -> None:
    dist.barrier()
    queue.close()
    queue.join_thread()  # the result must leave before os._exit
    os._exit(0)  # the retired groups' destructors would wait on the dead peer


# ---------------------------------------------------------------- replay and bench modes


def replay_worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=BUILD_TIMEOUT)
    gen = Generation(rank, store, args.comm_timeout, [mp.get_context("spawn").Event() for _ in range(2)])
    gen.enter(1)
    model, optimizer = build_model(args, gen.mesh())
    for step in range(args.warmup):
        train_step(model, optimizer, args, step, rank)
    saved = [tensor.clone() for tensor in local_state(model, optimizer)]
    digests = []
    for _ in range(args.replays):
        with torch.no_grad():
            for tensor, value in zip(local_state(model, optimizer), saved, strict=True):
                tensor.copy_(value)
        train_step(model, optimizer, args, args.warmup, rank)
        digests.append(digest(full_state(model, optimizer)))
    queue.put({"rank": rank, "digests": digests})
    finish(queue)


def bench_worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=BUILD_TIMEOUT)
    gen = Generation(rank, store, args.comm_timeout, [mp.get_context("spawn").Event() for _ in range(2)])
    gen.enter(1)
    stock_mesh = init_device_mesh("cpu", (REPLICATE, SHARD), mesh_dim_names=("replicate", "shard"))
    setups = {"swappable": build_model(args, gen.mesh()), "stock": build_model(args, stock_mesh)}
    timings: dict[str, list[float]] = {name: [] for name in setups}
    for step in range(args.warmup + args.steps):
        for name, (model, optimizer) in setups.items():  # interleaved: machine noise hits both alike
            dist.barrier()
            started = time.perf_counter()
            train_step(model, optimizer, args, step, rank)
            if step >= args.warmup:
                timings[name].append(time.perf_counter() - started)
    same = digest(full_state(*setups["swappable"])) == digest(full_state(*setups["stock"]))
    queue.put({"rank": rank, "timings": timings, "same_bits_as_stock": same, "calls": gen.calls()})
    finish(queue)


def run_simple(target: Callable[..., None], args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=BUILD_TIMEOUT)
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, args, store.port, queue)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=args.run_timeout) for _ in range(WORLD)]
    for proc in procs:
        proc.join(timeout=30)
    return sorted(results, key=lambda result: result["rank"])


# ---------------------------------------------------------------- parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["regroup", "replay", "bench"])
    parser.add_argument("--fault", choices=["kill", "hang"], default="kill", help="regroup: how rank --victim fails")
    parser.add_argument("--victim", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="regroup: total steps; bench: timed steps")
    parser.add_argument("--fault-step", type=int, default=4)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--comm-timeout", type=float, default=10.0)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--run-timeout", type=float, default=180.0)
    parser.add_argument("--clear-unsharded-grads", action=argparse.BooleanOptionalAction, default=True,
                        help="regroup: after reset_iter_state also drop the failed step's unsharded gradients")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args()
    result: dict[str, Any] = {"mode": args.mode, "torch": torch.__version__, "args": {
        k: v for k, v in vars(args).items() if k != "out"}}
    with tempfile.TemporaryDirectory() as scratch:
        args.scratch = scratch
        if args.mode == "regroup":
            started = time.monotonic()
            reference = run_regroup(args, "none", "reference")
            result["reference_s"] = round(time.monotonic() - started, 2)
            faulted = run_regroup(args, args.fault, "faulted")
            want = torch.load(Path(scratch) / "reference.pt")
            got = torch.load(Path(scratch) / "faulted.pt")
            mismatched = [name for name in want if not torch.equal(raw_bytes(want[name]), raw_bytes(got[name]))]
            result.update({
                "bitwise_equal": not mismatched and want.keys() == got.keys(),
                "mismatched": len(mismatched), "compared": len(want),
                "max_abs_diff": max((float((want[n].double() - got[n].double()).abs().max()) for n in mismatched),
                                    default=0.0),
                "losses": {label: {e["rank"]: e["losses"] for e in events if e["event"] == "done"}
                           for label, events in (("reference", reference), ("faulted", faulted))},
                "reference_digest": digest(want), "faulted_digest": digest(got),
                "failures": [e for e in faulted if e["event"] == "failed"],
                "regroup_s": {e["rank"]: e["seconds"] for e in faulted if e["event"] == "regrouped"},
                "newcomer_receive_s": [round(e["seconds"], 3) for e in faulted if e["event"] == "received"],
                "shard_digests": {e["event"]: e["local"] for e in faulted if e["event"] in ("received", "donated")},
                "calls_rank0": next(e["calls"] for e in reference if e["event"] == "done" and e["rank"] == 0),
            })
        elif args.mode == "replay":
            results = run_simple(replay_worker, args)
            digests = results[0]["digests"]
            result.update({"replays": len(digests), "distinct_digests": len(set(digests)), "digests": digests,
                           "ranks_agree": all(r["digests"] == digests for r in results)})
        else:
            results = run_simple(bench_worker, args)
            for name in ("swappable", "stock"):
                per_step = [max(r["timings"][name][i] for r in results) for i in range(args.steps)]
                result[f"{name}_median_ms"] = round(1000 * statistics.median(per_step), 2)
            result["overhead_pct"] = round(100 * (result["swappable_median_ms"] / result["stock_median_ms"] - 1), 1)
            result["same_bits_as_stock"] = all(r["same_bits_as_stock"] for r in results)
            result["calls_per_step_rank0"] = {op: round(n / (args.warmup + args.steps), 2)
                                              for op, n in results[0]["calls"].items()}
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
