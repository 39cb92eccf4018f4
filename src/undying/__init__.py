"""undying: fault-tolerant, resumable distributed training for PyTorch.

A training script calls ``undying.init()`` and keeps its shape; ``undying run``
launches it on every node with a controller that detects faults and recovers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from undying.runtime.core import Runtime


def init() -> Runtime:
    """Join the job from the environment the agent set; returns the worker's runtime."""
    from undying.runtime.core import init as runtime_init

    return runtime_init()


def param_sha256(module: Any) -> str:
    """SHA-256 over a module's parameters and buffers (bitwise identity of two runs)."""
    from undying.utils import param_sha256 as digest

    return digest(module)


__all__ = ["init", "param_sha256", "__version__"]
