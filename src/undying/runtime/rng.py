"""Capture and restore every RNG a training step may draw from (torch, CUDA, Python, NumPy).

Runs in the worker. Restoring these with the model, optimizer and data position is
what makes a replayed step bitwise equal to the original. Of CUDA, only the generator of
this rank's own device (``torch.cuda.current_device()``, which the runtime sets to
``cuda:LOCAL_RANK``) is captured and restored: a rank draws from no other, and a
replacement with another local rank must put the state into its own device's generator.
"""

from __future__ import annotations

import pickle
import random
import sys
from typing import Any

import torch

CUDA_KEY = "cuda_device"  # the generator state of the rank's own CUDA device (one tensor)
LEGACY_CUDA_KEY = "cuda"  # older captures: a list with one state per visible device


def _own_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[CUDA_KEY] = torch.cuda.get_rng_state(_own_device())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if torch.cuda.is_available():
        own_state = _own_cuda_state(state)
        if own_state is not None:
            torch.cuda.set_rng_state(own_state, _own_device())
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def _own_cuda_state(state: dict[str, Any]) -> torch.Tensor | None:
    """The own device's generator state, from a new capture or from an older one that holds every
    visible device's (the entry of the device index this process uses now)."""
    if CUDA_KEY in state:
        return state[CUDA_KEY]
    legacy = state.get(LEGACY_CUDA_KEY)
    if legacy:
        index = torch.cuda.current_device()
        return legacy[index] if index < len(legacy) else None
    return None


def same_rng(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Do two ``capture_rng()`` results hold the same states? A few microseconds, where encoding one
    (``rng_to_bytes``) takes tens: a step that draws no random numbers leaves every state as it was."""
    if a.keys() != b.keys() or not torch.equal(a["torch"], b["torch"]) or a["python"] != b["python"]:
        return False
    if CUDA_KEY in a and not torch.equal(a[CUDA_KEY], b[CUDA_KEY]):
        return False
    if LEGACY_CUDA_KEY in a:
        legacy_a, legacy_b = a[LEGACY_CUDA_KEY], b[LEGACY_CUDA_KEY]
        if len(legacy_a) != len(legacy_b) or not all(map(torch.equal, legacy_a, legacy_b)):
            return False
    if "numpy" in a:
        # NumPy's legacy state: (name, key array, position, has_gauss, cached gaussian).
        numpy_a, numpy_b = a["numpy"], b["numpy"]
        if len(numpy_a) != len(numpy_b) or numpy_a[0] != numpy_b[0] or tuple(numpy_a[2:]) != tuple(numpy_b[2:]):
            return False
        return bool((numpy_a[1] == numpy_b[1]).all())
    return True


def rng_to_bytes(state: dict[str, Any]) -> bytes:
    """A compact encoding of ``capture_rng()`` for the store: plain pickle of numpy arrays
    (a few KB, tens of microseconds; ``torch.save`` took milliseconds)."""
    plain = dict(state)
    plain["torch"] = state["torch"].numpy()
    if CUDA_KEY in state:
        plain[CUDA_KEY] = state[CUDA_KEY].cpu().numpy()
    if LEGACY_CUDA_KEY in state:
        plain[LEGACY_CUDA_KEY] = [tensor.cpu().numpy() for tensor in state[LEGACY_CUDA_KEY]]
    return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)


def rng_from_bytes(data: bytes) -> dict[str, Any]:
    # Only bytes this job's own ranks wrote into its store.
    plain = pickle.loads(data)  # noqa: S301
    plain["torch"] = torch.from_numpy(plain["torch"])
    if CUDA_KEY in plain:
        plain[CUDA_KEY] = torch.from_numpy(plain[CUDA_KEY])
    if LEGACY_CUDA_KEY in plain:
        plain[LEGACY_CUDA_KEY] = [torch.from_numpy(array) for array in plain[LEGACY_CUDA_KEY]]
    return plain
