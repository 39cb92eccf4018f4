"""The value ``ft.steps()`` yields: the step number, an ``int``, that can also guard the step's body.

Runs in the worker.
"""

from __future__ import annotations

from types import TracebackType

import torch

from undying.runtime.step_transaction import StepTransaction

# A Step pickles as a call of ``int`` (a subclass cannot pickle as the plain int opcode), which
# torch.load's default ``weights_only`` unpickler refuses unless ``int`` is on its allowlist: a
# script's checkpoint holding the step (``{'iter_num': step}``) then loads back with torch.load as
# it is written. ``int`` of pickled data runs no code of the file's.
torch.serialization.add_safe_globals([int])


class Step(int):
    """A step number that can also guard the step's body: ``with step: ...``.

    Inside the guard, an exception raised by the step (e.g. a transient error) does not
    kill the process when ``retry`` is enabled: this rank votes against the step, no
    rank applies it, and everyone re-runs it in the same processes.

    Anywhere else it is the plain ``int`` it stands for: arithmetic gives ints, ``json.dumps`` and
    f-strings write the number, and it pickles (``torch.save({'iter_num': step})``) and copies as
    ``int(step)``, never with the transaction it guards: loaded back, it is a plain ``int``. Not
    guaranteed: that a process which does not import undying loads it with torch.load's default
    ``weights_only=True`` (it needs ``torch.serialization.add_safe_globals([int])``, which undying
    calls; or write ``int(step)``).
    """

    _transaction: StepTransaction

    def __new__(cls, value: int, transaction: StepTransaction) -> Step:
        step = super().__new__(cls, value)
        step._transaction = transaction
        return step

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        # Again at each save: a script's ``with torch.serialization.safe_globals([...int...])`` removes
        # int from the allowlist on exit, and the process that saves is often the one that loads.
        torch.serialization.add_safe_globals([int])
        return int, (int(self),)

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        return self._transaction.step_raised(exc)
