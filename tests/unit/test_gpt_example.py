"""The GPT example's model and dataset, alone: shapes, gradients, and bitwise-repeatable training."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from undying.data import ResumableLoader
from undying.utils import param_sha256

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "gpt"


def load_example_module(name: str):
    spec = importlib.util.spec_from_file_location(f"gpt_example_{name}", EXAMPLE_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


model_module = load_example_module("model")
data_module = load_example_module("data")


@pytest.fixture(scope="module")
def corpus() -> str:
    return (EXAMPLE_DIR / "input.txt").read_text()


def small_config(vocab_size: int):
    return model_module.GPTConfig(vocab_size=vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_shipped_corpus_is_real_text_of_the_expected_size(corpus):
    assert 20_000 <= len(corpus.encode()) <= 60_000
    dataset = data_module.CharDataset(corpus, block_size=32)
    assert dataset.chars == sorted(set(corpus))
    assert len(dataset) == len(corpus) - 32


def test_char_dataset_items_are_shifted_by_one():
    dataset = data_module.CharDataset("hello world", block_size=4)
    assert dataset.vocab_size == len(set("hello world"))
    x, y = dataset[2]
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (4,)
    assert dataset.decode(x.tolist()) == "llo "
    assert dataset.decode(y.tolist()) == "lo w"
    assert dataset.decode(dataset[len(dataset) - 1][1].tolist()) == "orld"


def test_char_dataset_rejects_text_shorter_than_a_block():
    with pytest.raises(ValueError, match="block_size"):
        data_module.CharDataset("abc", block_size=3)


def test_forward_and_backward(corpus):
    dataset = data_module.CharDataset(corpus, block_size=16)
    torch.manual_seed(0)
    model = model_module.GPT(small_config(dataset.vocab_size))
    x, y = torch.utils.data.default_collate([dataset[i] for i in range(3)])

    logits, loss = model(x, y)
    assert logits.shape == (3, 16, dataset.vocab_size)
    # An untrained model is close to uniform over the vocabulary.
    assert abs(loss.item() - torch.log(torch.tensor(float(dataset.vocab_size))).item()) < 0.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

    logits, loss = model(x[:, :5])
    assert logits.shape == (3, 5, dataset.vocab_size) and loss is None


def train_three_steps(dataset, seed: int) -> str:
    torch.manual_seed(seed)
    model = model_module.GPT(small_config(dataset.vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = ResumableLoader(dataset, batch_size=4, seed=seed, rank=0, world_size=1)
    for _ in range(3):
        x, y = next(loader)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return param_sha256(model)


def test_same_seed_gives_bitwise_equal_parameters(corpus):
    dataset = data_module.CharDataset(corpus, block_size=16)
    first = train_three_steps(dataset, seed=0)
    assert train_three_steps(dataset, seed=0) == first
    assert train_three_steps(dataset, seed=1) != first
