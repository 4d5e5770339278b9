"""A plain DataLoader in a Runtime loop under N ranks: every rank trains on all the data.

Each step then trains on N times the samples one process's step takes, and each epoch on the
data N times over: a wrong result that nothing else reports (the loss looks fine). The
training forwards of set-up models outside ``rt.loader``'s batches before the loop's first
``rt.backward`` note a fingerprint of their inputs (the tensors, their elements, the sum and
the sum of squares of their values in float64, left on the device: a GAN's noise and its real
batch together); that backward compares every rank's (one small gather, once: nothing
afterwards) and stops every rank, before any gradient, when all are the same.

Every rank draws from the same random stream until then (see ``_seeding``), so a shuffled
DataLoader draws the same first batch everywhere too. A loop that shards its data itself (a
``DistributedSampler``) gives each rank other samples and passes; one that means every rank
to see the same batches says so with ``Runtime(same_data_on_every_rank=True)``.

Under tensor parallelism it is the other way round inside a tensor-parallel group: its ranks
split one model copy's layers and must see the same inputs (a layer split over inputs that
differ computes nothing anyone asked for, silently). So the first batch's fingerprints must
be equal within each group, whatever ``same_data_on_every_rank`` says, and differ between the
data-parallel ranks unless it says they may not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from distkit.errors import ConfigurationError
from distkit.strategies.base import Strategy

#: a fingerprint's numbers: tensors, elements, sum, sum of squares
_WIDTH = 4


class SameBatchCheck:
    """The fingerprint of this rank's first training batch outside rt.loader, compared once."""

    def __init__(self, strategy: Strategy, *, enabled: bool) -> None:
        self._strategy = strategy
        self._enabled = enabled
        split = strategy.data_world_size < strategy.world_size  # tensor-parallel groups
        #: still to compare (never in a world of one, under an elastic backend, or opted out
        #: where no tensor-parallel group must be checked)
        self.pending = (enabled or split) and strategy.world_size > 1 and not strategy.elastic
        #: the first batch's tensors and elements, and its sums (on the device)
        self._print: tuple[torch.Tensor, torch.Tensor] | None = None

    def observe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A set-up model's training forward outside rt.loader's batches, before the first
        backward: its inputs added to the fingerprint (no host sync)."""
        if not self.pending:
            return
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if not tensors:
            return
        with torch.no_grad():
            parts = []
            for x in tensors:
                x = x.detach()
                x = torch.view_as_real(x) if x.is_complex() else x
                x = x.to(torch.float64)
                parts.append(torch.stack([x.sum(), x.square().sum()]))
            sums = torch.stack(parts).sum(dim=0)  # on the device until compared
        sizes = torch.tensor(
            [float(len(tensors)), float(sum(x.numel() for x in tensors))], dtype=torch.float64
        )
        if self._print is not None:  # another forward before the first backward: added
            sizes, sums = sizes + self._print[0], sums + self._print[1]
        self._print = (sizes, sums)

    def settle(self, *, outside_loader: bool) -> None:
        """The loop's first ``rt.backward``: compare the ranks' fingerprints when it backs a
        batch outside rt.loader (a collective, every rank at its first backward), else end
        the check (rt.loader's batches are each rank's own share)."""
        if not self.pending:
            return
        self.pending = False
        if not outside_loader:
            return
        strategy = self._strategy
        if self._print is None:  # no tensor inputs: nothing to compare, on this rank
            mine = torch.full((_WIDTH,), float("nan"), dtype=torch.float64)
        else:
            sizes, sums = self._print
            mine = torch.cat([sizes, sums.cpu()])  # (the one host sync)
        self._print = None
        everyone = strategy.all_gather(mine).reshape(-1, _WIDTH).cpu()
        groups = strategy.data_groups
        _refuse_split_groups(everyone, groups)
        rows = [everyone[ranks[0]] for ranks in groups]  # a tensor-parallel group's first
        first = rows[0]
        if (
            not self._enabled
            or len(rows) == 1
            or any(torch.isnan(row).any() for row in rows)
            or not all(torch.equal(row, first) for row in rows)
        ):
            return
        world = len(rows)
        raise ConfigurationError(
            f"every one of the {world} ranks trained its first batch on the same inputs: a "
            f"DataLoader that is not rt.loader's gives every rank all the data, so each "
            f"step would train on {world} times its samples and each epoch on the data "
            f"{world} times over (nothing has been trained yet). Iterate rt.loader(dataset, "
            "batch_size=...), which gives each rank its share of every global batch (no "
            "DistributedSampler needed), or shard the data yourself with a "
            "DistributedSampler (and sampler.set_epoch(epoch) each epoch). If every rank is "
            "meant to see the same batches (or the inputs are random draws: every rank draws "
            "alike until the first rt.backward), create the Runtime with "
            "same_data_on_every_rank=True"
        )


def _refuse_split_groups(everyone: torch.Tensor, groups: list[list[int]]) -> None:
    """The ranks of a tensor-parallel group (one data rank) whose first inputs differ."""
    for share, ranks in enumerate(groups):
        rows = [everyone[r] for r in ranks]
        if all(torch.equal(row, rows[0]) or bool(torch.isnan(row).all()) for row in rows):
            continue
        raise ConfigurationError(
            f"ranks {ranks} form one tensor-parallel group (data-parallel rank {share}) and "
            "trained their first batch on different inputs: they split each layer of one "
            "model copy, so each must see the same samples, or the split layers compute "
            "nothing meaningful (nothing has been trained yet). Iterate rt.loader(dataset, "
            "batch_size=...), which shards by data-parallel rank, or shard yourself by "
            "rt.data_rank of rt.data_world_size (DistributedSampler(dataset, "
            "num_replicas=rt.data_world_size, rank=rt.data_rank)), not by rt.rank"
        )
