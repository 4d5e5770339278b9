"""FAKE ``apex.optimizers`` (modern generation): thin re-export of
``tests/support/fakes/_apex_common``."""

from apex._common.optimizers import FusedAdam, FusedLAMB, FusedSGD

__all__ = ["FusedAdam", "FusedLAMB", "FusedSGD"]
