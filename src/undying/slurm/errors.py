"""The one error every Slurm module raises for input it cannot use: a single line naming the variable,
flag or file, what is wrong and (where there is one) the fix. Runs wherever ``undying.slurm`` does."""

from __future__ import annotations


class SlurmError(ValueError):
    """A Slurm environment, host list, token file or request that cannot be used; one line."""
