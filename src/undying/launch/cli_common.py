"""What every ``undying`` command shares: one-line usage errors (exit 2) and reading the job's token.

Runs in the user's shell process (the CLI: ``cli.py``, ``cli_job.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    print(f"undying: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def read_token(path: str | None) -> str | None:
    """The job's token from ``path`` (--token-file), else from ``UNDYING_TOKEN``; one error line if unusable."""
    if path is None:
        return os.environ.get("UNDYING_TOKEN") or None
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        fail(f"--token-file: cannot read {path}: {error.strerror}")
    if len(token) < 16:
        fail(f"--token-file: the token in {path} is shorter than 16 characters")
    return token
