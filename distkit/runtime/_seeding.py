"""When a Runtime seeds torch, numpy and random, so that a model built after it starts from
the same weights on one process and on every rank of N.

At construction every rank is seeded alike, with ``seed``: a model (or anything random) built
next is the same on every rank and the same as one process builds. The set-up then makes every
rank start from rank 0's weights on every backend (DDP's and apex's wrappers, FSDP and Horovod
broadcast them; DeepSpeed's engine does), which one process has too. From the loop's first
``rt.backward`` on, each rank draws from its own stream, ``seed + rank`` (dropout masks and
augmentations differ between ranks as they differ between the samples of one process's
batch), the rule a Trainer's fit follows from its start. Until then the ranks draw alike, so a
plain shuffled DataLoader draws the same first batch on every rank, which that backward
catches (see ``_input_check``). A user who seeds torch themselves after the construction keeps
their generators: the first backward leaves them alone.
"""

from __future__ import annotations

import random

import numpy as np
import torch


class RankSeeding:
    """Seeds every rank alike now, and this rank's own stream from the first backward on."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        seed_generators(seed)

    def split(self, rank: int) -> None:
        """The loop's first backward (called once): this rank draws from ``seed + rank`` from
        here on (unless torch was seeded anew since the construction: the user's seeding
        stands)."""
        if torch.initial_seed() == self._seed:
            seed_generators(self._seed + rank)


def seed_generators(seed: int) -> None:
    """A fit that starts afresh: torch, numpy and random seeded (``seed + rank``)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
