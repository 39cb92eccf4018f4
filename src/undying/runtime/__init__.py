"""The worker-side runtime: what a training script talks to through ``undying.init()``."""

from undying.runtime.core import Runtime, init

__all__ = ["Runtime", "init"]
