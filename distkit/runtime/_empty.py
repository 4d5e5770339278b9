"""``distkit.init_empty()``: build a model with no values, on the meta device.

Inside it, torch creates parameters and buffers on ``meta``: shapes and dtypes, no storage, no
random draws. A strategy that shards (fsdp, DeepSpeed stage 3) then gives each rank storage for
its own slices only and initialises them as the normal build would have (see
``distkit/strategies/_meta_init.py``), so a model larger than one device's memory never exists
whole on any rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from distkit.strategies._meta_init import recording_rng
from distkit.strategies._tied_weights import recording_makers


@contextlib.contextmanager
def init_empty() -> Iterator[None]:
    """Build the model inside this block to create it on the meta device::

        torch.manual_seed(0)
        with distkit.init_empty():
            model = Transformer(config)      # no memory, no random draws
        trainer.fit(model, optimizer, data)  # fsdp, ZeRO-3: each rank makes its shard

    The weights then equal those of the same model built normally after the same
    ``torch.manual_seed`` (each module's ``reset_parameters()`` runs at the set-up, in the
    order the modules were built, from rank 0's random state where this block began: what
    draws from torch's generator between the build and the set-up changes nothing). A
    weight two modules share
    (``head.weight = emb.weight``) stays one, with the values of the module that made it.

    To fine-tune pretrained weights, ``distkit.load_weights(model, path)`` after the build:
    they are checked at once and read at the set-up (each rank its own slices under fsdp),
    in place of the initial values.
    """
    with torch.device("meta"), recording_makers(), recording_rng():
        yield
