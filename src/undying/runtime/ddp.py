"""Gradient averaging with DDP's semantics in a fixed layout whose float sums replay bit for bit.

Runs in the worker. As under DDP, gradients are averaged while ``backward()`` runs: each bucket's
all-reduce starts as soon as the gradients of its parameters are accumulated (overlapped with the
rest of the backward pass) and ``backward()`` returns with every rank holding the same averaged
gradients, so clipping, a GradScaler's inf check and norm logging see them. ``model.no_sync()``
skips the average for accumulation micro-batches. Stock DDP rebuilds its buckets after the first
iteration, so the first step after a restart would sum in another layout; here the layout depends
only on the parameter list (docs/design.md, "Why the gradient sync is not DDP"). The commit vote
is its own one-element float32 all-reduce at ``opt.step()``, the last point where a rank can fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from undying.protocol import Phase
from undying.runtime.pg import CollectiveError, GenerationGroup, flat_views

# A bucket is cut once it holds this many bytes (DDP's default cap): large enough that each
# all-reduce is bandwidth-bound, small enough that the first one starts early in the backward pass.
BUCKET_CAP_BYTES = 25 * 1024 * 1024
VOTE_DTYPE = torch.float32  # counts ranks exactly up to 2**24 (a bf16 sum of ones stops at 256)


def bucket_layout(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    """The fixed buckets: one dtype each (in order of first appearance), parameters in reverse
    registration order (the order backward produces them), cut when a bucket reaches ``cap_bytes``
    (a larger parameter is a bucket of its own). Depends only on the parameter list."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param in params:
        by_dtype.setdefault(param.dtype, []).append(param)
    buckets: list[list[torch.nn.Parameter]] = []
    for same_dtype in by_dtype.values():
        current: list[torch.nn.Parameter] = []
        size = 0
        for param in reversed(same_dtype):
            nbytes = param.numel() * param.element_size()
            if current and size + nbytes > cap_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(param)
            size += nbytes
        buckets.append(current)
    return buckets


def commit_vote(group: GenerationGroup, ok: bool, device: torch.device) -> bool:
    """The commit vote: True iff every rank of ``group`` voted ``ok`` (one float32 all-reduce)."""
    votes = torch.full((1,), 1.0 if ok else 0.0, dtype=VOTE_DTYPE, device=device)
    group.allreduce_sum(votes)
    return int(votes.item()) == group.world_size


def commit_vote_with_sums(group: GenerationGroup, ok: bool, reports: tuple[float, ...],
                          device: torch.device) -> tuple[bool, list[float]]:
    """The commit vote carrying ``reports`` of every rank: (every rank voted ``ok``, the sum of each
    report over the ranks), in one float64 all-reduce (exact for integers up to 2**53)."""
    votes = torch.tensor([1.0 if ok else 0.0, *reports], dtype=torch.float64, device=device)
    group.allreduce_sum(votes)
    total = votes.cpu().tolist()
    return int(total[0]) == group.world_size, total[1:]


class _Bucket:
    """One flat buffer holding the gradients of a fixed run of parameters of one dtype."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
        self.views = flat_views(params, self.flat)
        self.generation: int | None = None  # the generation whose collectives this buffer was given to

    def use_in(self, generation: int) -> None:
        """A fresh buffer for each generation: a collective of an abandoned generation may still
        write into the buffer it was handed (a peer that froze mid all-reduce wakes up and sends
        its part), and it must not land in the gradients of a later step."""
        if self.generation is not None and self.generation != generation:
            self.flat = torch.zeros_like(self.flat)
            self.views = flat_views(self.params, self.flat)
        self.generation = generation

    @torch.no_grad()
    def gather(self, weight: int) -> None:
        """This rank's gradients into the buffer (zeros for a parameter without one), times ``weight``."""
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(param.grad)
        if weight != 1:
            self.flat.mul_(weight)

    @torch.no_grad()
    def scatter(self, divisor: int) -> None:
        """The summed buffer divided by ``divisor`` back into the parameters' gradients."""
        self.flat.div_(divisor)
        for param, view in zip(self.params, self.views, strict=True):
            if param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)


class FixedLayoutDDP(torch.nn.Module):
    """Wraps a model so gradients are averaged over the current data-parallel world.

    Guarantees: within a step (``begin_step``), a backward pass averages the gradients when, as
    under DDP, a forward through this wrapper ran since the last backward with grad enabled and
    ``require_backward_grad_sync`` True (``no_sync()`` sets it False), and the step's last
    micro-batch was taken (``ready_to_sync``): when it returns, every rank holds the same averaged gradients, summed in an order
    that depends only on the parameter list and the world size (bitwise-reproducible replays).
    Backward passes before it accumulate locally. ``sync_gradients()`` completes the average of a
    step whose backward did not (no backward, a failed rank voting no): every rank issues the same
    collectives in the same order either way. A second averaged backward in one step raises: wrap
    the earlier ones in ``no_sync()``, as with DDP. Parameters and buffers start equal on every
    rank (broadcast from rank 0 at wrap time). A parameter without a gradient contributes zeros.

    After an elastic shrink (``set_replica_share``) the average stays the one over the
    job's full global batch: each replica's gradient is weighted by the share of the
    step's batch slots it covered and the sum is divided by the number of slots.

    Not guaranteed: reentrant activation checkpointing (``use_reentrant=True``) runs nested
    backward passes whose end is taken for the end of the whole one; use the non-reentrant kind.
    """

    def __init__(self, module: torch.nn.Module, group_of: Callable[[], GenerationGroup],
                 device: torch.device, broadcast: bool = True,
                 ready_to_sync: Callable[[], bool] = lambda: True,
                 bucket_cap_bytes: int = BUCKET_CAP_BYTES,
                 set_phase: Callable[[str], None] = lambda _phase: None) -> None:
        super().__init__()
        if isinstance(module, (FixedLayoutDDP, torch.nn.parallel.DistributedDataParallel)):
            raise ValueError(f"ft.wrap_model: the model is already wrapped by {type(module).__name__}; "
                             f"pass the plain module (undying averages its gradients itself)")
        # A torch.compile'd model trains through its compiled wrapper, but its state (checkpoints,
        # the repair, digests) is the plain module's: keys without "_orig_mod.", loadable either way.
        compiled = module if isinstance(getattr(module, "_orig_mod", None), torch.nn.Module) else None
        self.module: torch.nn.Module = compiled._orig_mod if compiled is not None else module  # type: ignore[assignment]
        object.__setattr__(self, "_call", compiled if compiled is not None else self.module)  # not a submodule
        self._group_of = group_of
        self._ready_to_sync = ready_to_sync
        # Waiting for peers is `syncing` to the controller: a rank `computing` for step_timeout with
        # no progress is taken for stalled, and the one stalled is the peer, not the waiting rank.
        self._set_phase = set_phase
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("wrap_model: the model has no parameters that require gradients")
        self._buckets = [_Bucket(run, device) for run in bucket_layout(params, bucket_cap_bytes)]
        self._bucket_of = {id(p): index for index, bucket in enumerate(self._buckets) for p in bucket.params}
        self._gradient_weight = 1  # slots covered by one backward of this replica (elastic ``grow``)
        self._slots_per_step: int | None = None  # None: divide by the process group's size
        # DDP's own attributes, read and written as under DDP: a forward run with grad enabled while
        # ``require_backward_grad_sync`` is True arms the next backward pass to average (``no_sync()``
        # only toggles it); ``require_forward_param_sync`` says whether the last forward was such a one.
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._armed = False  # a forward since the last backward asked that backward to average
        self._in_step = False
        self._reset_step()
        for param in params:
            param.register_post_accumulate_grad_hook(self._gradient_ready)
        if broadcast:
            self.sync_parameters()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self._call(*args, **kwargs)  # type: ignore[operator]  # set with object.__setattr__
        # As DDP decides in its forward: whether this forward's backward averages is settled here,
        # so a forward inside ``no_sync()`` and its backward outside accumulates, as under DDP.
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._armed = True
            self.require_forward_param_sync = True
        else:
            self.require_forward_param_sync = False
        return output

    @torch.no_grad()
    def sync_parameters(self, root: int = 0) -> None:
        """Make every rank's parameters and buffers equal to ``root``'s."""
        group = self._group_of()
        tensors = [p.data for p in self.module.parameters()] + list(self.module.buffers())
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same_dtype])
            group.broadcast(flat, root)
            for tensor, view in zip(same_dtype, flat_views(same_dtype, flat), strict=True):
                tensor.copy_(view)

    def set_replica_share(self, gradient_weight: int, slots_per_step: int | None) -> None:
        """Elastic training: this replica's gradient stands for ``gradient_weight`` batch slots (one
        larger batch) and the step's gradient is the sum over ``slots_per_step`` slots divided by it.
        ``(1, None)`` is the plain data-parallel mean over the group."""
        self._gradient_weight = gradient_weight
        self._slots_per_step = slots_per_step

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward passes inside accumulate gradients locally, without averaging them:
        as DDP's, it sets ``require_backward_grad_sync`` to False and puts it back."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    # ------------------------------------------------------------- one step's average

    def begin_step(self) -> None:
        """A new step: its gradients have not been averaged yet."""
        self._in_step = True
        self._armed = False
        self._reset_step()

    def _reset_step(self) -> None:
        self._averaged = False  # this step's gradients were averaged (or the attempt failed)
        self._failure: CollectiveError | None = None
        self._pending: list[tuple[_Bucket, dist.Work | None]] = []  # launched, in bucket order
        self._ready: list[int] = [0] * len(self._buckets)  # gradients accumulated, per bucket
        self._backward_running = False
        self._backward_averages = False

    def _gradient_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate hook of every parameter: start each bucket's all-reduce, in bucket order,
        once its gradients are in."""
        if not self._in_step:
            return
        if not self._backward_running:
            self._backward_running = True
            self._backward_averages = self._armed and self._ready_to_sync()
            self._armed = False
            if self._backward_averages and self._averaged:
                raise RuntimeError("undying: a second backward pass averaged the gradients of this step; "
                                   "wrap the earlier backward passes of the step in `with model.no_sync():` "
                                   "(as with DDP)")
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
        if not self._backward_averages:
            return
        self._ready[self._bucket_of[id(param)]] += 1
        while (len(self._pending) < len(self._buckets)
               and self._ready[len(self._pending)] == len(self._buckets[len(self._pending)].params)):
            self._launch_next()

    def _backward_finished(self) -> None:
        averages = self._backward_averages
        self._backward_running = self._backward_averages = False
        if averages:
            self._complete()

    def _launch_next(self) -> None:
        bucket = self._buckets[len(self._pending)]
        group = self._group_of()
        if self._failure is not None:
            self._pending.append((bucket, None))
            return
        bucket.use_in(group.generation)
        bucket.gather(self._gradient_weight)
        try:
            self._pending.append((bucket, group.start_allreduce(bucket.flat)))
        except CollectiveError as error:
            self._failure = error.retold()
            self._pending.append((bucket, None))

    def _complete(self) -> None:
        """Launch the buckets not yet launched (parameters unused in this backward), wait for every
        all-reduce, write the averages back. A failed collective is kept, not raised: the step
        fails at ``opt.step()`` (``sync_gradients``), where the runtime decides."""
        while len(self._pending) < len(self._buckets):
            self._launch_next()
        group = self._group_of()
        self._set_phase(Phase.SYNCING)
        pending, self._pending = self._pending, []
        work: dist.Work | None = None
        for bucket, work in pending:
            self._pending.append((bucket, None))  # no reference to a work outlives its wait
            if work is None:
                continue
            if self._failure is not None:
                group.abandon_work(work)  # dies with the group, in its reaper thread
                continue
            try:
                group.wait_work("allreduce", work)
            except CollectiveError as error:
                self._failure = error.retold()
        del pending, work
        self._set_phase(Phase.COMPUTING)
        self._averaged = True
        if self._failure is None:
            for bucket, _ in self._pending:
                bucket.scatter(self._slots_per_step or group.world_size)

    def sync_gradients(self) -> None:
        """Make sure this step's gradients are averaged (a no-op if its backward did it); raises the
        ``CollectiveError`` of a failed all-reduce. Outside a step it always averages anew."""
        if not self._in_step:
            self._reset_step()
        if not self._averaged:
            self._complete()
        if self._failure is not None:
            raise self._failure.retold()
