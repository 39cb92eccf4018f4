"""A GPT trainer written the way nanoGPT's train.py is, moved to undying by following docs/migrating.md.

Runs in every worker process (``undying run tests/scripts/nanogpt_style.py``) or alone under plain
``python``, for tests/faults/test_nanogpt_style.py. What nanoGPT does and this keeps: a small GPT
(weight-tied head, flash attention, decay/no-decay AdamW groups), gradient accumulation through
``model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)``, a GradScaler
built ``enabled=(dtype == 'float16')`` (disabled here), its own ``get_lr(it)`` written into every
``param_group['lr']``, ``raw_model = model.module``, evaluation on the main rank at the top of every
``eval_interval``-th iteration, its own checkpoint ``ckpt.pt`` (``iter_num`` among its keys), and
``init_from='resume'``. What the migration changed: ``undying.init()`` and the ``ft.*`` wrappers in
place of the DDP setup, training batches from ``ft.dataloader`` drawn at the top of each micro-step
(its worker process prefetches them across steps; the old prefetch into ``X, Y`` at the end of the
body is ``--prefetch-in-variable``, which undying refuses), ``ft.steps(max_iters, start=iter_num)``
in place of ``while True``, and the loader's position kept in ``ckpt.pt``.
"""

from __future__ import annotations

import argparse
import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

import undying

# --------------------------------------------------------------------------------------- the model


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, channels = x.size()
        heads = [part.view(batch, length, self.n_head, channels // self.n_head).transpose(1, 2)
                 for part in self.c_attn(x).split(channels, dim=2)]
        y = F.scaled_dot_product_attention(*heads, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(batch, length, channels)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
                                 nn.Dropout(config.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "wpe": nn.Embedding(config.block_size, config.n_embd),
            "drop": nn.Dropout(config.dropout),
            "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             device_type: str) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda" or None)


# ---------------------------------------------------------------------------------------- the data


def token_stream(length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """A learnable stream: each token follows the one before it by a fixed random bigram table."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.softmax(3 * torch.randn(vocab_size, vocab_size, generator=generator), dim=1)
    tokens = [0]
    for _ in range(length - 1):
        tokens.append(int(torch.multinomial(table[tokens[-1]], 1, generator=generator)))
    return torch.tensor(tokens, dtype=torch.long)


class Windows:
    """Every ``block_size`` window of a token stream and the window one token later (nanoGPT's x, y)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index:index + self.block_size], self.data[index + 1:index + 1 + self.block_size]


def main() -> None:
    parser = argparse.ArgumentParser(description="A GPT trainer in nanoGPT's shape, under undying.")
    parser.add_argument("--steps", type=int, default=24, help="max_iters")
    parser.add_argument("--out-dir", default="out")
    parser.add_argument("--init-from", choices=["scratch", "resume"], default="scratch")
    parser.add_argument("--eval-interval", type=int, default=8)
    parser.add_argument("--eval-iters", type=int, default=2)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=8, help="over all ranks, as nanoGPT's")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--num-workers", type=int, default=1, help="ft.dataloader's prefetching processes")
    parser.add_argument("--prefetch-in-variable", action="store_true",
                        help="nanoGPT's own prefetch (X, Y drawn at the end of the body): refused by undying")
    parser.add_argument("--final-state", default=None, help="rank 0 saves the final parameters here (tests)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    # nanoGPT's config, as module-level names there
    out_dir, eval_interval, log_interval, eval_iters = args.out_dir, args.eval_interval, 1, args.eval_iters
    always_save_checkpoint, init_from = True, args.init_from
    gradient_accumulation_steps, batch_size, block_size = args.gradient_accumulation_steps, args.batch_size, 16
    learning_rate, max_iters, weight_decay, beta1, beta2, grad_clip = 1e-2, args.steps, 1e-1, 0.9, 0.95, 1.0
    decay_lr, warmup_iters, lr_decay_iters, min_lr = True, 4, args.steps, 1e-3
    dtype = args.dtype
    config = {"learning_rate": learning_rate, "max_iters": max_iters, "batch_size": batch_size, "dtype": dtype}

    ft = undying.init()  # was: init_process_group(backend=backend) and the RANK/LOCAL_RANK/WORLD_SIZE reads
    master_process = ft.is_main
    seed_offset = ft.rank
    assert gradient_accumulation_steps % ft.world_size == 0
    gradient_accumulation_steps //= ft.world_size
    if master_process:
        os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(1337 + seed_offset)
    device, device_type = ft.device, ft.device.type
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.autocast(device_type=device_type, dtype=ptdtype)

    train_data, val_data = token_stream(3000, 64, seed=7), token_stream(600, 64, seed=8)
    train_loader = ft.dataloader(Windows(train_data, block_size), batch_size=batch_size, seed=1337,
                                 num_workers=args.num_workers, persistent_workers=args.num_workers > 0)

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split == "train":
            x, y = next(train_loader)
        else:  # evaluation samples as nanoGPT does, from this rank's RNG (rolled back by undying)
            data = train_data if split == "eval_train" else val_data
            ix = torch.randint(len(data) - block_size, (batch_size,))
            x = torch.stack([data[i:i + block_size] for i in ix])
            y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
        if device_type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    iter_num = 0
    best_val_loss = 1e9
    model_args = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": block_size, "bias": False,
                  "vocab_size": 64, "dropout": args.dropout}
    checkpoint = None
    if init_from == "scratch":
        model = GPT(GPTConfig(**model_args))
    else:
        checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device)
        for key in ["n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"]:
            model_args[key] = checkpoint["model_args"][key]
        model = GPT(GPTConfig(**model_args))
        state_dict = checkpoint["model"]
        for key in list(state_dict):
            if key.startswith("_orig_mod."):
                state_dict[key[len("_orig_mod."):]] = state_dict.pop(key)
        model.load_state_dict(state_dict)
        iter_num = checkpoint["iter_num"]
        best_val_loss = checkpoint["best_val_loss"]
        train_loader.load_state_dict(checkpoint["loader"])  # the migration's addition: the data position
    model.to(device)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
    if init_from == "resume":
        assert checkpoint is not None
        optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None
    model = ft.wrap_model(model)  # was: DDP(model, device_ids=[ddp_local_rank])
    optimizer = ft.wrap_optimizer(optimizer)

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ["eval_train", "val"]:
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                x, y = get_batch(split)
                with ctx:
                    _, loss = model(x, y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    def get_lr(it: int) -> float:
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)

    if args.prefetch_in_variable:
        X, Y = get_batch("train")  # nanoGPT: fetch the very first batch
    raw_model = model.module
    first_iter, lossf = None, float("nan")
    for step in ft.steps(max_iters, start=iter_num):  # was: while True ... iter_num += 1
        iter_num = step
        if first_iter is None:
            first_iter = int(iter_num)
            print(f"rank {ft.rank} first iter {iter_num} params {undying.param_sha256(raw_model)}", flush=True)
        with step:
            lr = get_lr(iter_num) if decay_lr else learning_rate
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            if iter_num % eval_interval == 0 and master_process:
                losses = estimate_loss()
                print(f"step {iter_num}: train loss {losses['eval_train']:.4f}, val loss {losses['val']:.4f}",
                      flush=True)
                if losses["val"] < best_val_loss or always_save_checkpoint:
                    best_val_loss = losses["val"]
                    if iter_num > 0:
                        checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                                      "model_args": model_args, "iter_num": iter_num,
                                      "best_val_loss": best_val_loss, "config": config,
                                      "loader": train_loader.state_dict()}
                        torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
            for micro_step in range(gradient_accumulation_steps):
                model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
                if not args.prefetch_in_variable:
                    X, Y = get_batch("train")  # drawn in the step, before its forward: rolled back with it
                with ctx:
                    logits, loss = model(X, Y)
                    loss = loss / gradient_accumulation_steps
                if args.prefetch_in_variable:
                    X, Y = get_batch("train")  # nanoGPT: prefetch the next batch while the GPU works
                scaler.scale(loss).backward()
            if grad_clip != 0.0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        if iter_num % log_interval == 0 and master_process:
            lossf = loss.item() * gradient_accumulation_steps
            print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}", flush=True)

    if args.final_state and master_process:
        torch.save(raw_model.state_dict(), args.final_state)
    ft.finish(result={"param_sha256": undying.param_sha256(raw_model), "final_loss": lossf,
                      "first_iter": first_iter, "model_args": asdict(GPTConfig(**model_args))})


if __name__ == "__main__":
    main()
