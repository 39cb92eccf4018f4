"""torch's ZeroRedundancyOptimizer (ZeRO-1 for DDP) is refused at ft.wrap_optimizer with one line that
names the FSDP2 way (runtime/optim.py); a plain optimizer passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from undying.runtime.optim import refuse_zero_redundancy


def test_zero_redundancy_optimizer_is_refused_with_the_fsdp2_way(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        with pytest.raises(ValueError, match=r"^ft.wrap_optimizer: ZeroRedundancyOptimizer is not supported.*"
                                             r"reshard_after_forward=False"):
            refuse_zero_redundancy(zero)
        refuse_zero_redundancy(torch.optim.AdamW(model.parameters(), lr=1e-3))
    finally:
        dist.destroy_process_group()
