"""Copying a state's tensors into snapshot memory: now, on the calling thread, or in the background
while training goes on.

Runs in the worker. ``copy_now`` is the synchronous copy of a T1 snapshot. ``BackgroundCopy``
is the overlapped one (``checkpoint.overlap``): the training thread hands it the tensors that
only an optimizer step changes (parameters, optimizer state) and goes on with the next step's
forward and backward (and, in a data-parallel job, its gradient all-reduce) while a helper
thread copies them; the runtime waits for it before it applies the next update. Device
tensors are copied on a side stream that first waits for an event recorded on the training
stream at hand-over, so the copy reads the values of the committed step and never queues
behind the next step's kernels.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from undying._torch_compat.tensors import foreach_copy


def updated_only_by(optimizers: Iterable[Any]) -> Callable[[torch.Tensor], bool]:
    """True for a tensor whose storage is a parameter one of ``optimizers`` updates, or that
    optimizer's state: nothing but its ``step()`` changes them, so their copy may overlap the
    next step's forward and backward."""
    storages: set[int] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            storages.update(param.untyped_storage().data_ptr() for param in group["params"])
        for per_param in optimizer.state.values():
            storages.update(value.untyped_storage().data_ptr() for value in per_param.values()
                            if isinstance(value, torch.Tensor))
    return lambda tensor: tensor.untyped_storage().data_ptr() in storages


def copy_now(views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    """Copy each tensor into its view (host memory) on this thread."""
    if not views:
        return
    if all(tensor.device.type == "cpu" for tensor in tensors):
        foreach_copy(views, tensors)
        return
    for view, tensor in zip(views, tensors, strict=True):
        view.copy_(tensor)  # device-to-host for a GPU job's tensors


class BackgroundCopy:
    """Copies ``tensors`` into ``views`` on a helper thread, then calls ``then`` (e.g. a commit).

    The caller must not change the tensors until ``wait`` returns (the runtime holds back the
    next optimizer step). ``done`` is set when the copy ended, well or not; ``error`` says how.
    """

    def __init__(self, views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
                 then: Callable[[], None], name: str = "undying-snapshot-copy") -> None:
        self._views = list(views)
        self._tensors = list(tensors)
        self._then = then
        self._ready = _record_ready_events(self._tensors)  # on the training thread, at hand-over
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            pairs = list(zip(self._views, self._tensors, strict=True))
            # Host tensors, and those of devices without an event (their copies queue on the stream
            # the training thread used, behind the committed update).
            other = [(view, tensor) for view, tensor in pairs if tensor.device not in self._ready]
            copy_now([view for view, _ in other], [tensor for _, tensor in other])
            for device, event in self._ready.items():
                _copy_from_device(device, event, [(view, tensor) for view, tensor in pairs if tensor.device == device])
            self._then()
        except BaseException as error:  # noqa: BLE001 - handed to the thread that waits
            self.error = error
        finally:
            self._views, self._tensors = [], []
            self.done.set()

    def wait(self) -> float:
        """Until the copy (and ``then``) finished; returns the seconds this call blocked. Raises
        if the copy failed."""
        started = time.perf_counter()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"background snapshot copy failed: {self.error!r}") from self.error
        return time.perf_counter() - started


def _record_ready_events(tensors: Sequence[torch.Tensor]) -> dict[torch.device, torch.cuda.Event]:
    """One event per device, recorded on the training thread's current stream: the copy of that
    device's tensors starts after everything queued so far (the committed step's update)."""
    events: dict[torch.device, torch.cuda.Event] = {}
    for tensor in tensors:
        if tensor.device.type == "cuda" and tensor.device not in events:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
            events[tensor.device] = event
    return events


def _copy_from_device(device: torch.device, ready: torch.cuda.Event,
                      pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            for view, tensor in pairs:
                # Asynchronous into page-locked slots (the stream is synchronized below); into pageable
                # memory CUDA copies synchronously either way.
                view.copy_(tensor, non_blocking=True)
        stream.synchronize()
