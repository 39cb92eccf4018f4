"""The controller: one per job, on node 0 (membership, health, recovery decisions)."""

from undying.controller.core import Controller
from undying.controller.server import ControllerServer
from undying.controller.state import JobState
from undying.controller.store import JobStore

__all__ = ["Controller", "ControllerServer", "JobState", "JobStore"]
