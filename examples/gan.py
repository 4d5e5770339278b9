"""A small DCGAN-style GAN on MNIST, in a hand-written loop on ``distkit.Runtime``.

    python examples/gan.py                                     # one process
    torchrun --standalone --nproc_per_node 2 examples/gan.py   # DDP, 2 processes
    horovodrun -np 2 python examples/gan.py                    # Horovod, 2 processes

Two models, two optimizers, two ``rt.backward`` calls per batch (the discriminator's loss,
then the generator's): a loop the Trainer's one-model ``fit`` cannot express. The Runtime
sets both models up on the chosen backend, gives each rank its share of every global batch
(``--batch-size`` is per process: N processes with ``b`` see what one process sees with
``N * b``), and weights each loss so that the averaged gradients are those of the global
batch. Rank 0 writes a PNG grid of generated digits after every epoch (``--out-dir``;
Pillow), and prints the epoch's losses. The data: the same MNIST files as
``examples/mnist.py`` (fetched by rank 0 when missing).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import example_cli
import numpy as np
import torch
import torch.nn.functional as F
from mnist_data import MEAN, STD, load_mnist
from mnist_fetch import FetchError, ensure_mnist
from torch import nn

import distkit

LATENT = 32
PILLOW_HINT = "saving the sample grids needs Pillow: pip install pillow"


class Generator(nn.Module):
    """Latent vector -> 1 x 28 x 28 image in [-1, 1] (transposed convolutions)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.width = width
        self.project = nn.Sequential(nn.Linear(LATENT, 2 * width * 7 * 7), nn.ReLU())
        self.upsample = nn.Sequential(
            nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1),  # 14 x 14
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.ConvTranspose2d(width, 1, 4, stride=2, padding=1),  # 28 x 28
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.upsample(self.project(z).view(-1, 2 * self.width, 7, 7))


class Discriminator(nn.Module):
    """1 x 28 x 28 image -> one logit (real or generated)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 4, stride=2, padding=1),  # 14 x 14
            nn.LeakyReLU(0.2),
            nn.Conv2d(width, 2 * width, 4, stride=2, padding=1),  # 7 x 7
            nn.LeakyReLU(0.2),
            nn.Flatten(),
            nn.Linear(2 * width * 7 * 7, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto", help="ddp, dp, horovod, fsdp, apex, ...")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--precision", default="32", help="32, bf16 or fp16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-samples", type=int, default=None, help="use the first N images")
    parser.add_argument("--data-dir", default=None, help="MNIST IDX files (else the cache)")
    parser.add_argument("--out-dir", default="gan_samples", help="PNG grids, one per epoch")
    parser.add_argument("--save-weights", default=None, help="the generator's weights (rank 0)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    example_cli.limit_threads()
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    with distkit.Runtime(args.strategy, precision=args.precision, seed=args.seed) as rt:
        images = load_images(rt, args)
        if images is None:
            return 2
        gen, disc = Generator(), Discriminator()
        betas = (0.5, 0.999)
        gen, opt_g = rt.setup(gen, torch.optim.Adam(gen.parameters(), lr=args.lr, betas=betas))
        disc, opt_d = rt.setup(disc, torch.optim.Adam(disc.parameters(), lr=args.lr, betas=betas))
        loader = rt.loader(images, batch_size=args.batch_size, shuffle=True, drop_last=True)
        noise = torch.Generator().manual_seed(args.seed * 1000 + rt.rank)  # this rank's
        fixed = torch.randn(64, LATENT, generator=torch.Generator().manual_seed(args.seed))
        rt.print(
            f"GAN on {len(images):,} images: strategy={rt.strategy.name}, "
            f"world_size={rt.world_size}, batch {args.batch_size} per process, "
            f"{len(loader)} batches per epoch"
        )
        for epoch in range(args.epochs):
            start = time.perf_counter()
            sums = torch.zeros(3)  # discriminator loss, generator loss, batches
            for (real,) in loader:
                z = torch.randn(len(real), LATENT, generator=noise).to(rt.device)
                fake = gen(z)
                # the discriminator: real images are 1, generated ones 0
                scores = disc(torch.cat([real, fake.detach()]))
                labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
                d_loss = F.binary_cross_entropy_with_logits(scores, labels.to(rt.device))
                opt_d.zero_grad()
                rt.backward(d_loss)
                opt_d.step()
                # the generator: make the discriminator say 1
                g_loss = F.binary_cross_entropy_with_logits(
                    disc(fake), torch.ones(len(real), 1, device=rt.device)
                )
                opt_g.zero_grad()
                # this loss reaches both models: say which optimizer it is for (legacy apex
                # scales it with that optimizer's loss scale; other backends ignore it)
                rt.backward(g_loss, optimizer=opt_g)
                opt_g.step()
                sums += torch.stack([d_loss.detach().cpu(), g_loss.detach().cpu(), torch.ones(())])
            means = rt.all_reduce(sums, op="sum")
            d_mean, g_mean = (means[:2] / means[2]).tolist()
            seconds = time.perf_counter() - start
            rt.print(f"epoch {epoch + 1}/{args.epochs}: d_loss={d_mean:.4f} "
                     f"g_loss={g_mean:.4f} ({seconds:.1f} s)")  # fmt: skip
            # every rank runs the generator (a forward of a set-up model may communicate:
            # DDP's buffer broadcast, FSDP's gathers); rank 0 writes the picture
            samples = generate(gen, fixed, rt)
            if rt.is_main:
                path = save_grid(samples, Path(args.out_dir) / f"epoch-{epoch + 1:03d}.png")
                print(f"samples: {path}", flush=True)
        if args.save_weights:
            weights = rt.full_state_dict(gen)  # a collective: every rank
            if rt.is_main:
                torch.save(weights, args.save_weights)
    return 0


def load_images(rt: distkit.Runtime, args: argparse.Namespace) -> torch.utils.data.Dataset | None:
    """MNIST's training images in [-1, 1] (labels dropped); None on every rank when any rank
    could not load them. Rank 0 fetches missing files first, while the others wait."""
    failure: Exception | None = None
    with rt.main_process_first():  # nothing may escape it on rank 0: the others wait there
        try:
            if rt.is_main:
                ensure_mnist(args.data_dir, log=lambda line: print(f"fetch: {line}", flush=True))
        except (FetchError, OSError) as exc:
            failure = exc
    if failure is None:
        try:
            train = load_mnist(args.data_dir, split="train", max_samples=args.max_samples)
        except Exception as exc:
            failure = exc
    failed = rt.all_reduce(torch.tensor([float(failure is not None)]), op="sum").item() > 0
    if failed:
        if failure is not None:
            print(f"error: rank {rt.rank} could not load MNIST: {failure}", file=sys.stderr)
        return None
    pixels = train.tensors[0] * STD + MEAN  # back to [0, 1] ...
    return torch.utils.data.TensorDataset(pixels * 2 - 1)  # ... then to the Tanh's [-1, 1]


@torch.no_grad()
def generate(gen: nn.Module, z: torch.Tensor, rt: distkit.Runtime) -> torch.Tensor:
    """The generator's images for the latents ``z`` (eval mode), on the CPU, in [-1, 1]."""
    was_training = gen.training
    gen.eval()
    images = gen(z.to(rt.device)).float().cpu().clamp(-1, 1)
    gen.train(was_training)
    return images


def save_grid(images: torch.Tensor, path: Path) -> Path:
    """``images`` (``(64, 1, 28, 28)`` in [-1, 1]) as an 8 x 8 grid in a PNG."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise SystemExit(PILLOW_HINT) from exc
    tiles = ((images[:, 0] + 1) * 127.5).round().to(torch.uint8).numpy()
    rows, gap = 8, 2
    side = 28 + gap
    grid = np.full((rows * side + gap, rows * side + gap), 255, dtype=np.uint8)
    for k, tile in enumerate(tiles[: rows * rows]):
        r, c = divmod(k, rows)
        grid[gap + r * side : gap + r * side + 28, gap + c * side : gap + c * side + 28] = tile
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).resize((grid.shape[1] * 2, grid.shape[0] * 2)).save(path)
    return path


if __name__ == "__main__":
    sys.exit(example_cli.run(main))
