"""One process's part of a job, for a user's own loop (:class:`Runtime`), and the door the
Trainer comes in by.

Below the Trainer and above the strategies, the data and the checkpoint format. What the
runtime promises is what this module exports, in two parts:

- **The user's**: :class:`Runtime` (``distkit.Runtime``) and its settings
  (:class:`RuntimeOptions`), what it hands back
  (:class:`SetUpModel`, :class:`SetUpOptimizer`, :class:`RuntimeLoader`, and
  :class:`PendingSave` for a save that persists in the background),
  :class:`Profiler`, :func:`init_empty` and :func:`read_predictions` (``distkit.X`` each).
- **The Trainer's port**: what the Trainer's loop needs beyond ``Runtime``, each for the
  reason given in :data:`PORT`. The Trainer imports the runtime from here and nowhere else;
  ``tests/test_layers.py`` holds it to that. A name leaves the port when the Runtime's public
  face grows the call it stands for.

Inside, one concept a module: the set-up models and optimizers (``_set_up``, ``_setups``),
the loop's bookkeeping (``_loop``), what each collective call checks before it starts
(``_preparation``), ranks that disagree or sit in different calls failing at once
(``_agreement``, ``_call_tags``), every sample counted once (``_evaluation``), the Runtime's
checkpoints and weights (``_user_checkpoint``, ``_weights``, ``_rank_zero_write``), its
settings (``_runtime_options``), ``torch.compile``, activation checkpointing, determinism,
seeding and the argument checks (``_runtime_arguments``).
"""

from distkit.runtime._agreement import (
    Proposal,
    describe_model,
    exchange,
    named_shapes,
    per_data_rank,
)
from distkit.runtime._background_save import PendingSave
from distkit.runtime._call_tags import tagged_sum
from distkit.runtime._checkpointing import ActivationCheckpointing
from distkit.runtime._compile import Compiler, check_compile
from distkit.runtime._compile import describe as describe_compile
from distkit.runtime._compile import plan as compile_plan
from distkit.runtime._empty import init_empty
from distkit.runtime._evaluation import LossFn, Metrics, named_metrics
from distkit.runtime._loader import RuntimeLoader
from distkit.runtime._port import guarded, loader_spec, renew_topology, require_open
from distkit.runtime._predict import PredictFn
from distkit.runtime._prediction_files import read_predictions
from distkit.runtime._preemption import agreed_stop
from distkit.runtime._preparation import checked_placement, describe_data, samples_of
from distkit.runtime._profiler import Profiler, ProfileRun, open_profile, profiler_settings
from distkit.runtime._rank_zero_write import write_on_rank_zero
from distkit.runtime._runtime import Runtime
from distkit.runtime._runtime_arguments import check_model, check_not_set_up
from distkit.runtime._runtime_options import RuntimeOptions
from distkit.runtime._seeding import seed_generators
from distkit.runtime._set_up import SetUpModel, SetUpOptimizer, foreign_tensors
from distkit.runtime._step_result import training_loss
from distkit.runtime._weights import DEFAULT_MAX_SHARD_SIZE, save_weights

#: the Trainer's port: each name, and why the Trainer needs it beyond ``Runtime``
PORT: dict[str, str] = {
    "Proposal": "fit, save_checkpoint and load_checkpoint agree across ranks before they act",
    "exchange": "the same agreement, for the Trainer's own collective calls",
    "per_data_rank": "a checkpoint's per-rank records, one per data-parallel rank",
    "describe_model": "fit's agreement names the model every rank must pass",
    "named_shapes": "fit's agreement compares the model's parameters across ranks",
    "tagged_sum": "the loop's host-side sums (stop requests, log windows, non-finite losses)",
    "ActivationCheckpointing": "the type of Trainer(activation_checkpointing=...)",
    "Compiler": "fit's model is compiled once per set-up, as rt.setup compiles it",
    "check_compile": "Trainer(compile=...) is checked at construction",
    "describe_compile": "fit's hyperparameter line names the compile options",
    "compile_plan": "a model the user compiled trains its module, compiled in the backend's order",
    "LossFn": "fit's and evaluate's loss_fn type",
    "Metrics": "fit's and evaluate's metrics type",
    "named_metrics": "fit's validation names its metrics as evaluate does",
    "RuntimeLoader": "fit's training data is a loader the Runtime builds",
    "PredictFn": "Trainer.predict's predict_fn type",
    "agreed_stop": "a preemption stops every rank at the same step",
    "checked_placement": "fit checks where the user placed the model, as rt.setup does",
    "describe_data": "fit's agreement names the data every rank must pass",
    "samples_of": "a mid-epoch resume checks the data's length; checkpoints record it",
    "ProfileRun": "fit's step loop marks the profiler's ranges",
    "Profiler": "Trainer(profiler=...)'s type",
    "open_profile": "fit opens the profiler over its steps",
    "profiler_settings": "Trainer(profiler=...) is checked at construction",
    "write_on_rank_zero": "the Trainer's checkpoints are written as rt.save writes",
    "PendingSave": "checkpoint_async's saves persist as rt.save(blocking=False)'s do",
    "seed_generators": "a fit that starts afresh seeds every generator",
    "SetUpModel": "fit trains the model rt.setup would return",
    "SetUpOptimizer": "fit steps the optimizer rt.setup would return",
    "foreign_tensors": "fit refuses an optimizer over another model's tensors",
    "training_loss": "the loss fit's step returns is checked as rt.backward checks it",
    "check_model": "fit's argument checks",
    "check_not_set_up": "fit refuses an optimizer rt.setup returned",
    "save_weights": "Trainer.save_weights writes the Runtime's weights format",
    "DEFAULT_MAX_SHARD_SIZE": "Trainer.save_weights's default shard size",
    "guarded": "fit runs under the Runtime's fail-fast guard, with its preemption",
    "loader_spec": "fit reads its data as rt.loader reads it",
    "renew_topology": "an elastic fit reads the re-formed group's place",
    "require_open": "a Trainer refuses a closed Runtime",
}

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "PORT",
    "ActivationCheckpointing",
    "Compiler",
    "LossFn",
    "Metrics",
    "PendingSave",
    "PredictFn",
    "ProfileRun",
    "Profiler",
    "Proposal",
    "Runtime",
    "RuntimeLoader",
    "RuntimeOptions",
    "SetUpModel",
    "SetUpOptimizer",
    "agreed_stop",
    "check_compile",
    "check_model",
    "check_not_set_up",
    "checked_placement",
    "compile_plan",
    "describe_compile",
    "describe_data",
    "describe_model",
    "exchange",
    "foreign_tensors",
    "guarded",
    "init_empty",
    "loader_spec",
    "named_metrics",
    "named_shapes",
    "open_profile",
    "per_data_rank",
    "profiler_settings",
    "read_predictions",
    "renew_topology",
    "require_open",
    "samples_of",
    "save_weights",
    "seed_generators",
    "tagged_sum",
    "training_loss",
    "write_on_rank_zero",
]
