"""Shared implementation of the FAKE NVIDIA apex packages used by distkit's tests.

Nothing here is NVIDIA code. Both fake generations (``tests/support/fakes/apex_legacy`` for
apex <= 25.04 and ``tests/support/fakes/apex_modern`` for apex >= 25.07) load this directory as
their private subpackage ``apex._common`` (see their ``apex/__init__.py``), so:

* there is one implementation of the recorder, the fused optimizers and the normalization layers;
* every activation of a fake (``tests.support.fakes.use_fake_apex``) gets fresh module state,
  because ``apex._common`` is dropped from ``sys.modules`` together with every other ``apex.*``
  module;
* the fakes need neither the ``tests`` package nor extra ``sys.path`` entries, so a subprocess
  launched with ``PYTHONPATH=tests/support/fakes/apex_legacy`` imports them too.

This directory is not importable as ``apex`` by itself and has no ``amp`` / ``parallel``: those
exist only in the legacy package.
"""

from . import deprecation, normalization, optimizers, recorder

__all__ = ["deprecation", "normalization", "optimizers", "recorder"]
