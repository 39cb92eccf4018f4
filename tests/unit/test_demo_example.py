"""``undying demo`` runs the repository's GPT example: the path it looks for is that file."""

from __future__ import annotations

from pathlib import Path

from undying.launch.demo import EXAMPLE

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_finds_the_repository_example() -> None:
    assert EXAMPLE == REPO / "examples" / "gpt" / "train.py"
    assert EXAMPLE.is_file()
