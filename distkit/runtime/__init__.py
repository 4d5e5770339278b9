"""What lives as long as a Trainer's process: set-up models, agreement, evaluation, checkpoints.

Below the training loop and above the strategies, the data and the checkpoint format:

- :mod:`._runtime`: :class:`Runtime`, one process's part of the job: the strategy set up,
  models set up once, this rank's place, loader descriptions, evaluation, the fail-fast
  guard; the Trainer holds one and runs its loop over it;
- :mod:`._fit_state`: where a fit stands (``FitState``), and the ``Stateful`` protocol for
  what a checkpoint carries besides tensors;
- :mod:`._setups`: each model and optimizer is set up once per Trainer;
- :mod:`._preparation`: what each collective call checks before it starts;
- :mod:`._agreement` and :mod:`._call_tags`: ranks that disagree, or that are in different
  calls, fail at once on every rank;
- :mod:`._evaluation`: every sample counted once, whatever the world size;
- :mod:`._saving`, :mod:`._resume`, :mod:`._snapshot`: checkpoints written, found and
  restored; a fit's state in memory for elastic backends;
- :mod:`._compile`, :mod:`._arguments`: ``torch.compile`` and the argument checks.

The next issue makes a public bring-your-own-loop layer of it (``distkit.Runtime``).
"""
