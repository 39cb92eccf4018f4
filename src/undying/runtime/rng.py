"""Capture and restore every RNG a training step may draw from (torch, CUDA, Python, NumPy).

Runs in the worker. Restoring these with the model, optimizer and data position is
what makes a replayed step bitwise equal to the original.
"""

from __future__ import annotations

import pickle
import random
import sys
from typing import Any

import torch


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def rng_to_bytes(state: dict[str, Any]) -> bytes:
    """A compact encoding of ``capture_rng()`` for the store: plain pickle of numpy arrays
    (a few KB, tens of microseconds; ``torch.save`` took milliseconds)."""
    plain = dict(state)
    plain["torch"] = state["torch"].numpy()
    if "cuda" in state:
        plain["cuda"] = [tensor.cpu().numpy() for tensor in state["cuda"]]
    return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)


def rng_from_bytes(data: bytes) -> dict[str, Any]:
    # Only bytes this job's own ranks wrote into its store.
    plain = pickle.loads(data)  # noqa: S301
    plain["torch"] = torch.from_numpy(plain["torch"])
    if "cuda" in plain:
        plain["cuda"] = [torch.from_numpy(array) for array in plain["cuda"]]
    return plain
