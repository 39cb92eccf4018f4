"""Gradient averaging with DDP's semantics and DDP's arithmetic, in layouts whose float sums replay bit for bit.

Runs in the worker. As under DDP, gradients are averaged while ``backward()`` runs: each bucket's
all-reduce starts as soon as the gradients of its parameters are accumulated (overlapped with the
rest of the backward pass) and ``backward()`` returns with every rank holding the same averaged
gradients, so clipping, a GradScaler's inf check and norm logging see them. A forward run while
``require_backward_grad_sync`` is True arms its backward to average (``no_sync()`` toggles it);
several averaged backward passes in one step each average into ``.grad``. The buckets are DDP's
(runtime/ddp_layout.py): its first layout for the job's first average, then the one rebuilt from
the recorded gradient order, kept as job state so a replay sums in the layout of the step it
replaces (docs/design.md, "Why the gradient sync is not DDP"). Buffers: runtime/ddp_buffers.py.
The commit vote is its own all-reduce at ``opt.step()``, the last point where a rank can fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from undying._torch_compat.tensors import map_tensors
from undying._torch_compat.training import compiled_original, queue_backward_callback
from undying.protocol import Phase
from undying.runtime.ddp_buckets import Bucket, CommHook, stock_hook
from undying.runtime.ddp_buffers import BufferSync, broadcast_tensors
from undying.runtime.ddp_layout import BucketOrder, complete_order, initial_layout, rebuilt_layout
from undying.runtime.ddp_options import DDPOptions, check_sync_batchnorm
from undying.runtime.pg import CollectiveError, GenerationGroup

VOTE_DTYPE = torch.float32  # counts ranks exactly up to 2**24 (a bf16 sum of ones stops at 256)


def commit_vote(group: GenerationGroup, ok: bool, device: torch.device) -> bool:
    """The commit vote: True iff every rank of ``group`` voted ``ok`` (one float32 all-reduce)."""
    votes = torch.full((1,), 1.0 if ok else 0.0, dtype=VOTE_DTYPE, device=device)
    group.allreduce_sum(votes)
    return int(votes.item()) == group.world_size


class FixedLayoutDDP(torch.nn.Module):
    """Wraps a model so gradients are averaged over the current data-parallel world, as DDP does.

    Guarantees: within a step (``begin_step``), a backward pass averages the gradients when, as
    under DDP, a forward through this wrapper ran since the last backward with grad enabled and
    ``require_backward_grad_sync`` True (``no_sync()`` sets it False), and the step's last
    micro-batch was taken (``ready_to_sync``): when it returns, every rank holds the same averaged
    gradients. Each further averaged backward of the step averages what ``.grad`` holds then
    (DDP's: the earlier averages plus the new local gradients); before it, ``before_extra_round``
    lets every rank learn whether a peer has given the step up. Every round sums in DDP's bucket
    layout of that point in the job's history (``BucketOrder``), with DDP's arithmetic or one of
    torch's stock comm hooks. ``sync_gradients()`` completes the average of a step whose backward
    did not (no backward, a failed rank voting no): every rank issues the same collectives in the
    same order either way. Parameters (and buffers) start equal on every rank (broadcast from rank 0
    at wrap time); with ``broadcast_buffers`` the buffers are rank 0's again at every commit.

    After an elastic shrink (``set_replica_share``) the average stays the one over the job's
    full global batch: each replica's gradient is weighted by the share of the step's batch
    slots it covered and the sum is divided by the number of slots.

    Not guaranteed: reentrant activation checkpointing (``use_reentrant=True``) runs nested
    backward passes whose end is taken for the end of the whole one; use the non-reentrant kind.
    """

    def __init__(self, module: torch.nn.Module, group_of: Callable[[], GenerationGroup],
                 device: torch.device, broadcast: bool = True,
                 ready_to_sync: Callable[[], bool] = lambda: True,
                 set_phase: Callable[[Phase], None] = lambda _phase: None,
                 options: DDPOptions | None = None,
                 before_extra_round: Callable[[], bool] = lambda: True,
                 in_gradient_sync: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        if isinstance(module, (FixedLayoutDDP, torch.nn.parallel.DistributedDataParallel)):
            raise ValueError(f"ft.wrap_model: the model is already wrapped by {type(module).__name__}; "
                             f"pass the plain module (undying averages its gradients itself)")
        self.options = options = options or DDPOptions()
        # A torch.compile'd model trains through its compiled wrapper, but its state (checkpoints,
        # the repair, digests) is the plain module's: keys without "_orig_mod.", loadable either way.
        original = compiled_original(module)
        compiled = module if original is not None else None
        self.module: torch.nn.Module = original if original is not None else module
        object.__setattr__(self, "_call", compiled if compiled is not None else self.module)  # not a submodule
        check_sync_batchnorm(self.module, device)
        self._group_of = group_of
        self._device = device
        self._ready_to_sync = ready_to_sync
        self._before_extra_round = before_extra_round
        self._in_gradient_sync = in_gradient_sync  # each round, once its first bucket is in flight (injection)
        # Waiting for peers is `syncing` to the controller: a rank `computing` for step_timeout with
        # no progress is taken for stalled, and the one stalled is the peer, not the waiting rank.
        self._set_phase = set_phase
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("wrap_model: the model has no parameters that require gradients")
        self._index_of = {id(p): index for index, p in enumerate(self._params)}
        self.bucket_order = BucketOrder(len(self._params))  # job state: registered by the runtime
        self._buckets: list[Bucket] = []
        self._built_from: list[int] | None = None  # the ready order the buckets were laid out from
        self._bucket_of: dict[int, int] = {}
        self._lay_out()
        self.buffer_sync = BufferSync(self.module)
        self._hook = CommHook.NONE
        self._rounds_ever = 0
        self._gradient_weight = 1  # slots covered by one backward of this replica (elastic ``grow``)
        self._slots_per_step: int | None = None  # None: divide by the process group's size
        self._weights_total: int | None = None  # the replicas' weights summed (None: slots_per_step)
        # DDP's own attributes, read and written as under DDP: a forward run with grad enabled while
        # ``require_backward_grad_sync`` is True arms the next backward pass to average (``no_sync()``
        # only toggles it); ``require_forward_param_sync`` says whether the last forward was such a one.
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.device_ids = options.device_ids
        self.output_device = options.output_device
        self.dim = 0
        self.find_unused_parameters = options.find_unused_parameters
        self.gradient_as_bucket_view = options.gradient_as_bucket_view
        self.static_graph = options.static_graph
        self.bucket_bytes_cap = options.bucket_bytes
        self.device = self._params[0].device
        self._armed = False  # a forward since the last backward asked that backward to average
        self._in_step = False
        self._reset_step()
        for param in self._params:
            param.register_post_accumulate_grad_hook(self._gradient_ready)
        if broadcast and options.init_sync:
            self.sync_parameters(buffers=options.init_sync_buffers)

    @property
    def broadcast_buffers(self) -> bool:
        return self.options.broadcast_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.options = dataclasses.replace(self.options, broadcast_buffers=bool(value))

    @property
    def process_group(self) -> Any:
        """The current generation's default group (DDP's attribute; undying averages over its own group)."""
        return dist.group.WORLD

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.device_ids:  # as DDP's: inputs go to the model's device
            args, kwargs = map_tensors(lambda tensor: tensor.to(self.device), (args, kwargs))
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
    def sync_parameters(self, root: int = 0, buffers: bool = True) -> None:
        """Make every rank's parameters (and buffers) equal to ``root``'s."""
        tensors = [p.data for p in self.module.parameters()] + (list(self.module.buffers()) if buffers else [])
        broadcast_tensors(self._group_of(), tensors, root)

    def sync_buffers(self) -> None:
        """With ``broadcast_buffers``: every rank's buffers made group rank 0's (a collective)."""
        if self.options.broadcast_buffers and self.buffer_sync.named():
            self.buffer_sync.broadcast(self._group_of())

    def set_replica_share(self, gradient_weight: int, slots_per_step: int | None,
                          weights_total: int | None = None) -> None:
        """Elastic training: this replica's gradient stands for ``gradient_weight`` batch slots (one
        larger batch) and the step's gradient is the sum over ``slots_per_step`` slots divided by it;
        ``weights_total`` is the replicas' weights summed, when not ``slots_per_step`` (``accumulate``:
        one per replica). ``(1, None)`` is the plain data-parallel mean over the group."""
        self._gradient_weight = gradient_weight
        self._slots_per_step = slots_per_step
        self._weights_total = weights_total

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

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's, for torch's stock hooks (``allreduce_hook``, ``fp16_compress_hook``,
        ``bf16_compress_hook``), run in the fixed buckets; any other hook is refused."""
        kind = stock_hook(hook)
        if kind is None:
            raise ValueError(f"model.register_comm_hook: {getattr(hook, '__qualname__', hook)!r} is not supported; "
                             f"undying runs torch's stock hooks (allreduce_hook, fp16_compress_hook, "
                             f"bf16_compress_hook of torch.distributed.algorithms.ddp_comm_hooks.default_hooks)")
        if state is not None:
            raise ValueError("model.register_comm_hook: state must be None (the default group): undying sums "
                             "over each generation's own group")
        if self._hook is not CommHook.NONE:
            raise RuntimeError("model.register_comm_hook: a communication hook can only be registered once (as DDP's)")
        if self._rounds_ever:
            raise RuntimeError("model.register_comm_hook: register it before the first backward pass (as DDP "
                               "requires): a replacement process must sum every step the same way")
        self._hook = kind

    # ------------------------------------------------------------- layout and commit boundary

    def _lay_out(self) -> None:
        """The buckets for the current point in the job's history (``bucket_order``)."""
        order, options = self.bucket_order.ready_order, self.options
        if self._buckets and order == self._built_from:
            return
        if order is None:
            layout = initial_layout(self._params, options.find_unused_parameters, options.first_bucket_bytes,
                                    options.bucket_bytes)
        else:
            layout = rebuilt_layout(self._params, order, options.first_bucket_bytes, options.bucket_bytes)
        self._buckets = [Bucket([self._params[index] for index in run], self._device) for run in layout]
        self._bucket_of = {id(p): index for index, bucket in enumerate(self._buckets) for p in bucket.params}
        self._bucket_sizes = [len(bucket.params) for bucket in self._buckets]
        self._built_from = None if order is None else list(order)

    def averaged_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this wrapper averages (those that require a gradient), in
        the module's order. The list itself: not to be changed."""
        return self._params

    def mark_commit_boundary(self) -> None:
        self.buffer_sync.mark_commit_boundary()

    def forget_failed_step(self) -> None:
        """The buffers as they were at the commit boundary (a failed step's forwards changed them)."""
        self.buffer_sync.roll_back()

    # ------------------------------------------------------------- one step's averages

    def begin_step(self) -> None:
        """A new step: its gradients have not been averaged yet."""
        self._in_step = True
        self._armed = False
        self._reset_step()

    def _reset_step(self) -> None:
        self._rounds = 0  # averaging rounds started in this step
        self._round_open = False  # a round started and not completed
        self._refused = False  # a peer gave the step up (learnt before a further round)
        self._failure: CollectiveError | None = None
        self._pending: list[tuple[Bucket, dist.Work | None]] = []  # launched, in bucket order
        self._ready: list[int] = [0] * len(self._buckets)  # gradients accumulated, per bucket
        self._average_before: dict[int, torch.Tensor] | None = None  # the step's average so far (elastic)
        self._fired: dict[int, None] = {}  # parameter indices in the order their gradients came (ordered set)
        self._backward_running = False
        self._backward_averages = False

    def _gradient_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate hook of every parameter: start each bucket's all-reduce, in bucket order,
        once its gradients are in."""
        if not self._in_step:
            return
        if self.bucket_order.ready_order is None:
            self._fired.setdefault(self._index_of[id(param)])
        if not self._backward_running:
            self._backward_running = True
            self._backward_averages = self._armed and not self._refused and self._ready_to_sync()
            self._armed = False
            if self._backward_averages and self._rounds > 0:
                self._backward_averages = self._before_extra_round()
                self._refused = not self._backward_averages
            if self._backward_averages:
                self._start_round()
            queue_backward_callback(self._backward_finished)
        if not self._backward_averages:
            return
        bucket = self._bucket_of[id(param)]
        self._ready[bucket] += 1
        # Only the completion of the next bucket to launch launches anything: it, and the complete
        # ones after it (a later bucket that completed first waited for it).
        if bucket == len(self._pending) and self._ready[bucket] == self._bucket_sizes[bucket]:
            while (len(self._pending) < len(self._buckets)
                   and self._ready[len(self._pending)] == self._bucket_sizes[len(self._pending)]):
                self._launch_next()

    def _backward_finished(self) -> None:
        averages = self._backward_averages
        self._backward_running = self._backward_averages = False
        if averages:
            self._complete()

    def _divisor(self, group: GenerationGroup) -> int:
        return self._slots_per_step or group.world_size

    def _start_round(self) -> None:
        self._lay_out()
        self._rounds += 1
        self._rounds_ever += 1
        self._round_open = True
        self._pending = []
        self._ready = [0] * len(self._buckets)

    def _correction(self) -> float:
        """A further round sums every replica's gradient, which holds the earlier average once per
        replica; with weights that do not add up to the slots (``accumulate``) the sum is corrected
        by the missing (slots - weights) copies of it. Zero in a plain job and under ``grow``."""
        if self._slots_per_step is None or self._weights_total is None:
            return 0.0
        return (self._slots_per_step - self._weights_total) / self._slots_per_step

    def _launch_next(self) -> None:
        bucket = self._buckets[len(self._pending)]
        group = self._group_of()
        if self._failure is not None:
            self._pending.append((bucket, None))
            return
        bucket.use_in(group.generation)
        bucket.gather(self._hook, self._gradient_weight, self._divisor(group))
        try:
            self._pending.append((bucket, bucket.start(group, self._hook, self._divisor(group))))
        except CollectiveError as error:
            self._failure = error.retold()
            self._pending.append((bucket, None))
            return
        if len(self._pending) == 1:
            self._in_gradient_sync()

    def _complete(self) -> None:
        """Launch the buckets not yet launched (parameters unused in this backward), wait for every
        all-reduce, write the averages back; in the job's first round, agree on the gradient order
        (rank 0's, as DDP). A failed collective is kept, not raised: the step fails at
        ``opt.step()`` (``sync_gradients``), where the runtime decides."""
        while len(self._pending) < len(self._buckets):
            self._launch_next()
        group = self._group_of()
        self._set_phase(Phase.SYNCING)
        used = self._start_used_map(group)
        pending, self._pending = self._pending, []
        work: dist.Work | None = None
        for bucket, work in [*pending, *([] if used is None else [(None, used[1])])]:
            if bucket is not None:
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
        if self._failure is None and self.bucket_order.ready_order is None and self._in_step:
            self._record_order(group)  # outside a step (tools, tests) no backward order was watched
        self._set_phase(Phase.COMPUTING)
        self._round_open = False
        if self._failure is None:
            unused = set() if used is None else {id(self._params[index])
                                                 for index in torch.nonzero(used[0] == 0).flatten().tolist()}
            correction = self._correction()
            for bucket, _ in self._pending:
                bucket.finish(self.options.gradient_as_bucket_view, unused, correction, self._average_before)
            if correction:  # a further round of the step adds what it misses of this average
                self._average_before = {id(param): view.clone() for bucket, _ in self._pending
                                        for param, view in zip(bucket.params, bucket.views, strict=True)}

    def _start_used_map(self, group: GenerationGroup) -> tuple[torch.Tensor, dist.Work | None] | None:
        """With ``find_unused_parameters``: which parameters have a gradient on some rank (DDP leaves
        the others untouched), summed beside the buckets."""
        if not self.options.find_unused_parameters:
            return None
        used = torch.tensor([param.grad is not None for param in self._params], dtype=torch.int32,
                            device=self._device)
        if self._failure is not None:
            return used, None
        try:
            return used, group.start_allreduce(used)
        except CollectiveError as error:
            self._failure = error.retold()
            return used, None

    def _record_order(self, group: GenerationGroup) -> None:
        """The job's first round: the order this backward produced the gradients, rank 0's for all."""
        order = torch.tensor(complete_order(list(self._fired), len(self._params)), dtype=torch.int64,
                             device=self._device)
        try:
            group.broadcast(order, 0)
        except CollectiveError as error:
            self._failure = error.retold()
            return
        self.bucket_order.ready_order = order.tolist()

    def sync_gradients(self) -> None:
        """Make sure this step's gradients are averaged (a no-op if a backward did it and no round is
        left open); raises the ``CollectiveError`` of a failed all-reduce. Outside a step it always
        averages anew."""
        if not self._in_step:
            self._reset_step()
        if self._rounds == 0:
            self._start_round()
        if self._round_open:
            self._complete()
        if self._failure is not None:
            raise self._failure.retold()
