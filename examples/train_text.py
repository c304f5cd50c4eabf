"""Train a tiny transformers language model on real text with fprep, evaluating between epochs.

    python examples/train_text.py                                  # one process, CPU
    torchrun --nproc-per-node 2 examples/train_text.py             # two ranks (gloo on CPU)

The text is ``examples/data/coriolanus.txt`` (the opening of Shakespeare's *Coriolanus*, public
domain; pass ``--text`` for your own file). A byte-level BPE tokenizer is trained on it with the
``tokenizers`` package (no download); the tokens are cut into windows, the last tenth of them
kept apart for evaluation. The model is a small Llama from transformers, built on the meta
device and prepared by ``fprep.prepare`` (FSDP2 under torchrun, nothing to shard in one
process); the loaders go through ``prepare`` too, so each rank reads its share.

The evaluation loss is the mean over every evaluation token, whatever the number of ranks:
each rank sums its windows' token losses, ``fprep.gather_for_metrics`` collects the sums of
every rank (dropping the windows repeated to give all ranks even batches) and they are divided
by the token count. ``--split-batches`` is on, so ``--batch-size`` is the global batch: 1 and 2
ranks train on the same batches and print the same losses, up to float rounding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import fprep

DEFAULT_TEXT = Path(__file__).parent / "data" / "coriolanus.txt"


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a UTF-8 text file")
    p.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per training window")
    p.add_argument("--batch-size", type=int, default=16, help="windows per step, all ranks")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--max-steps", type=int, default=0, help="per epoch; 0: the whole epoch")
    p.add_argument("--strategy", default="fsdp", help="fprep strategy (fsdp, ddp, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, help="write the losses here as JSON (rank 0)")
    return p.parse_args(argv)


def train_tokenizer(text: str, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``text``: every rank trains the same one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def windows(ids: list[int], seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len`` tokens (the remainder is dropped)."""
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def build_model(vocab_size: int, args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):  # no memory, no init: prepare materializes each rank's shards
        return LlamaForCausalLM(config)


def token_losses(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window: the sum of its next-token losses, and how many tokens it predicts."""
    logits = model(input_ids=ids).logits[:, :-1]
    targets = ids[:, 1:]
    losses = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    return losses.sum(dim=1), torch.full((ids.shape[0],), targets.shape[1], dtype=torch.float32)


@torch.no_grad()
def evaluate(state: fprep.PrepState, model: torch.nn.Module, loader: Any) -> float:
    """The mean loss over every evaluation token, across all ranks."""
    model.eval()
    total, count = 0.0, 0.0
    for (ids,) in loader:
        sums, tokens = token_losses(model, ids)
        total += float(fprep.gather_for_metrics(state, sums, loader).sum())
        count += float(fprep.gather_for_metrics(state, tokens, loader).sum())
    model.train()
    return total / count


def check_same_tokens(state: fprep.PrepState, ids: list[int]) -> None:
    """Every rank tokenized the text the same way (they trained their tokenizers apart)."""
    digest = int.from_bytes(hashlib.sha256(str(ids).encode()).digest()[:6], "little")
    value = torch.tensor([float(digest)], dtype=torch.float64)
    low, high = fprep.reduce(state, value, "min"), fprep.reduce(state, value, "max")
    if not torch.equal(low, high):
        raise SystemExit("the ranks' tokenizers disagree: train it once and load it everywhere")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    text = args.text.read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text, args.vocab_size)
    ids = tokenizer.encode(text).ids
    data = windows(ids, args.seq_len)
    held_out = max(1, round(len(data) * args.eval_fraction))
    train_set, eval_set = TensorDataset(data[:-held_out]), TensorDataset(data[-held_out:])

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = build_model(tokenizer.get_vocab_size(), args)
    cfg = fprep.PrepConfig(
        strategy=args.strategy, wrap=LlamaDecoderLayer, seed=args.seed, split_batches=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(eval_set, batch_size=args.batch_size)
    state, model, optimizer, train_loader, eval_loader = fprep.prepare(
        model, cfg, optimizer, train_loader, eval_loader
    )
    check_same_tokens(state, ids)
    fprep.print_once(
        state,
        f"{len(text)} characters -> {len(ids)} tokens (vocabulary {tokenizer.get_vocab_size()}); "
        f"{len(train_set)} training and {len(eval_set)} evaluation windows of {args.seq_len}",
    )
    evals = [evaluate(state, model, eval_loader)]
    fprep.print_once(state, f"before training: eval loss {evals[0]:.4f}")
    train_losses: list[float] = []
    for epoch in range(1, args.epochs + 1):
        for step, (batch,) in enumerate(train_loader, start=1):
            loss = model(input_ids=batch, labels=batch).loss
            fprep.backward(state, model, loss)
            fprep.optimizer_step(state, optimizer)
            optimizer.zero_grad()
            train_losses.append(float(fprep.reduce(state, loss.detach(), "mean")))
            if step == args.max_steps:
                break
        evals.append(evaluate(state, model, eval_loader))
        fprep.print_once(
            state,
            f"epoch {epoch}: train loss {train_losses[-1]:.4f}, eval loss {evals[-1]:.4f}, "
            f"perplexity {math.exp(evals[-1]):.1f}",
        )
    if args.results is not None and fprep.is_main_process(state):
        args.results.write_text(json.dumps({"eval": evals, "train": train_losses}))
    fprep.end_training(state)
    return 0 if evals[-1] < evals[0] else 1


if __name__ == "__main__":
    sys.exit(main())
