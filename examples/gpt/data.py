"""Character-level next-token dataset for the GPT example.

Runs in worker processes (imported by train.py); a plain map-style dataset, so
undying's ResumableLoader can shard and resume it.
"""

from __future__ import annotations

import torch


class CharDataset:
    """Item i is (x, y): block_size characters from offset i, and the same shifted by one."""

    def __init__(self, text: str, block_size: int) -> None:
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.itos = dict(enumerate(self.chars))
        self.block_size = block_size
        self.data = torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)
        if len(self.data) <= block_size:
            raise ValueError(f"text has {len(self.data)} characters, need more than block_size {block_size}")

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[index : index + self.block_size + 1]
        return chunk[:-1], chunk[1:]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids)
