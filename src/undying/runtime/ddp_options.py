"""DDP's constructor arguments as ``ft.wrap_model(model, **kwargs)`` takes them: the ones with a meaning
here, checked, and one line for each that has none, naming it and why. Also the check of a model's
``SyncBatchNorm`` layers.

Runs in the worker, once per wrapped model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from undying.runtime.ddp_layout import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, MIB

# Arguments of DistributedDataParallel that have no meaning under undying, and why.
REFUSED = {
    "process_group": "undying averages over each generation's own group, rebuilt at every recovery; leave it out",
    "device_mesh": "undying averages over each generation's own group; for FSDP2/HSDP build the mesh with "
                   "ft.device_mesh(...) (docs/sharding.md)",
    "mixed_precision": "DDP's experimental parameter casting is not supported; use torch.autocast in the forward",
    "delay_all_reduce_named_params": "delayed all-reduces are not supported; every parameter is averaged in its bucket",
    "param_to_hook_all_reduce": "delayed all-reduces are not supported; every parameter is averaged in its bucket",
    "skip_all_reduce_unused_params": "not supported: every rank must issue the same collectives whatever it used; "
                                     "find_unused_parameters=True keeps globally unused gradients untouched",
    "bucket_cap_mb_list": "per-bucket caps are not supported; use bucket_cap_mb",
    "check_reduction": "deprecated by torch and without effect; leave it out",
    "batched_grad_copy": "not supported: gradients are copied into their buckets one by one, as DDP does without it",
}
ACCEPTED = ("device_ids", "output_device", "dim", "broadcast_buffers", "forward_sync_buffers", "init_sync",
            "bucket_cap_mb", "find_unused_parameters", "gradient_as_bucket_view", "static_graph")


@dataclass(frozen=True)
class DDPOptions:
    """The DDP arguments a wrapped model honours (DDP's defaults unless given)."""

    device_ids: list[int] | None = None  # one CUDA device index (inputs are moved there), or None
    output_device: int | None = None
    broadcast_buffers: bool = True  # buffers made rank 0's at every step (``ddp_buffers.py``)
    init_sync_buffers: bool = True  # buffers broadcast at wrap time too (DDP's ``broadcast_buffers=False`` does not)
    init_sync: bool = True  # parameters (and buffers) broadcast from rank 0 at wrap time
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
    bucket_bytes: int = DEFAULT_BUCKET_CAP_MB * MIB
    find_unused_parameters: bool = False  # gradients no rank produced are left untouched, as DDP's
    gradient_as_bucket_view: bool = False  # gradients are views of their bucket after each average
    static_graph: bool = False  # a promise DDP uses to allow reentrant backwards; recorded only


def parse_ddp_options(kwargs: dict[str, Any], device: torch.device) -> DDPOptions:
    """The options of ``ft.wrap_model(model, **kwargs)``; raises one line for an argument it refuses."""
    for name, value in kwargs.items():
        if name in REFUSED and value is not None and value is not False:  # DDP's default is no use of it
            raise ValueError(f"ft.wrap_model: {name} is not supported: {REFUSED[name]}")
        if name not in REFUSED and name not in ACCEPTED:
            raise ValueError(f"ft.wrap_model: {name!r} is not an argument of DistributedDataParallel; "
                             f"allowed: {', '.join(ACCEPTED)}")
    flags = {name: _flag(kwargs, name, default) for name, default in (
        ("find_unused_parameters", False), ("gradient_as_bucket_view", False), ("static_graph", False),
        ("init_sync", True))}
    if kwargs.get("dim", 0) != 0:
        raise ValueError(f"ft.wrap_model: dim={kwargs['dim']!r} is not supported: DDP uses it only to scatter "
                         f"inputs over several devices of one process; leave it at 0")
    broadcast = kwargs.get("broadcast_buffers")
    forward_sync = kwargs.get("forward_sync_buffers")
    for name, value in (("broadcast_buffers", broadcast), ("forward_sync_buffers", forward_sync)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"ft.wrap_model: {name} must be True or False, got {value!r}")
    # As DDP's: forward_sync_buffers (torch 2.13) wins and keeps the sync at wrap time;
    # broadcast_buffers=False turns off both.
    per_step = forward_sync if forward_sync is not None else (broadcast if broadcast is not None else True)
    at_wrap = True if forward_sync is not None else per_step
    cap_mb = kwargs.get("bucket_cap_mb")
    if cap_mb is not None and (isinstance(cap_mb, bool) or not isinstance(cap_mb, (int, float)) or cap_mb <= 0):
        raise ValueError(f"ft.wrap_model: bucket_cap_mb must be a number of MiB > 0, got {cap_mb!r}")
    bucket_bytes = int((cap_mb if cap_mb is not None else DEFAULT_BUCKET_CAP_MB) * MIB)
    return DDPOptions(
        device_ids=_device_ids(kwargs.get("device_ids"), device),
        output_device=_output_device(kwargs.get("output_device"), device),
        broadcast_buffers=per_step, init_sync_buffers=at_wrap, init_sync=flags["init_sync"],
        # DDP cuts its first rebuilt bucket at 1 MiB only when bucket_cap_mb is left at its default.
        first_bucket_bytes=DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else bucket_bytes, bucket_bytes=bucket_bytes,
        find_unused_parameters=flags["find_unused_parameters"],
        gradient_as_bucket_view=flags["gradient_as_bucket_view"], static_graph=flags["static_graph"])


def _flag(kwargs: dict[str, Any], name: str, default: bool) -> bool:
    value = kwargs.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"ft.wrap_model: {name} must be True or False, got {value!r}")
    return value


def _device_index(value: Any) -> int | None:
    if isinstance(value, torch.device):
        return value.index
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        return torch.device(value).index
    raise ValueError(f"ft.wrap_model: a device must be an int or a torch.device, got {value!r}")


def _device_ids(value: Any, device: torch.device) -> list[int] | None:
    """DDP's ``device_ids``: None (or empty) for a CPU model; one CUDA index, this rank's device."""
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return None
    if device.type != "cuda":
        raise ValueError(f"ft.wrap_model: device_ids={value!r} is for a CUDA model (as under DDP); this rank's "
                         f"device is {device}: leave it out")
    if not isinstance(value, (list, tuple)) or len(value) != 1:
        raise ValueError(f"ft.wrap_model: device_ids must hold one device, this rank's ({device}), got {value!r}")
    index = _device_index(value[0])
    if index != device.index:
        raise ValueError(f"ft.wrap_model: device_ids={value!r} names another device than this rank's, "
                         f"{device} (ft.device)")
    return [index]


def _output_device(value: Any, device: torch.device) -> int | None:
    if value is None:
        return None
    if device.type != "cuda" or _device_index(value) != device.index:
        raise ValueError(f"ft.wrap_model: output_device={value!r}: the output stays on this rank's device, "
                         f"{device} (ft.device); leave it out")
    return device.index


def check_sync_batchnorm(module: torch.nn.Module, device: torch.device) -> None:
    """``SyncBatchNorm`` runs on GPU only (torch has no CPU kernels for it; DDP refuses it on CPU too), and
    its collectives must go to the default group, which undying rebuilds for every generation."""
    for name, layer in module.named_modules():
        if not isinstance(layer, torch.nn.SyncBatchNorm):
            continue
        if device.type == "cpu":
            raise ValueError(f"ft.wrap_model: SyncBatchNorm ({name or 'the model'}) needs a GPU: torch has no CPU "
                             f"kernels for it (DDP refuses it on CPU too); on CPU keep the plain BatchNorm, whose "
                             f"buffers are broadcast from rank 0 at every step")
        if layer.process_group is not None:
            raise ValueError(f"ft.wrap_model: SyncBatchNorm ({name}) was given a process group; leave it out "
                             f"(convert_sync_batchnorm(model)): its collectives then go to the default group, "
                             f"which undying rebuilds at every recovery")
