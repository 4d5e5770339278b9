"""One process's part of a distributed job, whatever loop runs on it.

A :class:`Runtime` resolves and connects the strategy, keeps each model and optimizer set up
once, knows this rank's place (rank, world size, device) and where it is in its work (for the
watchdog's hang reports), turns a Dataset, DataLoader or stream into the loader description
every rank agrees on, evaluates with every sample counted once, and runs work under the
fail-fast guard. The Trainer holds one and runs its loop over it; it takes no Trainer and
knows no loop (the next issue makes it a public bring-your-own-loop API).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from distkit.data import LoaderSpec
from distkit.data._feed import eval_batches
from distkit.data._stream_spec import StreamSpec, is_stream
from distkit.faults._faults import fail_fast
from distkit.faults._progress import Progress
from distkit.registry import make_strategy
from distkit.runtime import _agreement
from distkit.runtime._evaluation import LossFn, Metrics, as_score, evaluate_shard
from distkit.runtime._preparation import prepare_evaluate
from distkit.runtime._setups import SetupCache
from distkit.strategies.base import Strategy, Topology, TrainOptions


class Runtime:
    """The strategy, set up for ``options``, and what lives as long as this process uses it.

    Args:
        strategy: ``"auto"``, a registered name or a :class:`~distkit.Strategy` instance.
        options: what the strategy is set up for (precision, accumulation, sync BN, ...).
    """

    def __init__(self, strategy: str | Strategy, options: TrainOptions) -> None:
        self.strategy = make_strategy(strategy)
        self.strategy.start(options)
        #: this rank's place; kept past close() (handlers after a failure still ask "am I
        #: rank 0?"), and renewed when an elastic strategy re-forms its group
        self.topology: Topology = self.strategy.topology
        self.setups = SetupCache(self.strategy)
        #: where this rank is (step, phase), for the watchdog's hang reports
        self.progress = Progress()
        self._failure_channel: Any = None
        self._finalizer = weakref.finalize(self, self.setups.shutdown)

    # ------------------------------------------------------------------ place
    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        return self.topology.rank == 0

    @property
    def device(self) -> torch.device:
        return self.topology.device

    def renew_topology(self) -> None:
        """Read the strategy's place again (an elastic group re-formed: new rank, new size)."""
        self.topology = self.strategy.topology

    # ------------------------------------------------------------------ life
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Tear the strategy down (destroys a process group distkit created). Idempotent."""
        self._finalizer()

    def close_after_failure(self) -> None:
        """Close, keeping the side channel alive while this runtime lives.

        For torch.distributed the side channel is the rendezvous store, which rank 0 hosts
        when no torchrun agent does: peers read the failure notice from it after our closed
        connections wake them up.
        """
        self._failure_channel = self.strategy.side_channel()
        self.close()

    @contextlib.contextmanager
    def guarded(self, *, fault_timeout: float | None, hang_warning: float | None) -> Iterator[None]:
        """Run the block under the fail-fast guard: an error on this rank stops every rank
        (see :mod:`distkit.faults._faults`); this runtime closes after a failure."""
        with fail_fast(
            self.strategy,
            fault_timeout=fault_timeout,
            hang_warning=hang_warning,
            progress=self.progress,
            on_failure=self.close_after_failure,
        ):
            yield

    # ------------------------------------------------------------------ data
    def loader_spec(
        self, data: Any, what: str, *, batch_size: int, shuffle: bool, num_workers: int
    ) -> LoaderSpec | StreamSpec:
        """``data`` (a Dataset, a DataLoader or a stream) as what every rank will load."""
        pin_memory = self.device.type == "cuda"
        if is_stream(data):
            return StreamSpec.from_data(
                data,
                batch_size=batch_size,
                num_workers=num_workers,
                pin_memory=pin_memory,
                what=what,
            )
        return LoaderSpec.from_data(
            data,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            pin_memory=pin_memory,
            what=what,
        )

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        model: nn.Module,
        data: Any,
        loss_fn: LossFn | None,
        metrics: Metrics | None,
        *,
        batch_size: int,
        num_workers: int,
        seed: int,
        input_device: torch.device | None,
    ) -> dict[str, float]:
        """Loss and metrics over ``data``, every sample counted once over all ranks; the
        same plain floats on every rank. A collective (the ranks agree on the call first)."""
        strategy = self.strategy

        def prepare() -> _agreement.Proposal[Any]:
            def read() -> LoaderSpec | StreamSpec:
                return self.loader_spec(
                    data, "val_data", batch_size=batch_size, shuffle=False, num_workers=num_workers
                )

            return prepare_evaluate(self.setups, model, read, loss_fn, metrics, input_device)

        (named, spec, placement), _ = _agreement.exchange(strategy, "evaluate", prepare)
        scores = evaluate_shard(
            strategy,
            strategy.eval_model(self.setups.wrapped(model)),
            eval_batches(strategy, spec, seed),
            loss_fn,
            named,
            placement,
        )
        return {key: as_score(key, value) for key, value in scores.items()}
