"""FAKE ``apex.normalization`` (legacy generation): re-export of
``tests/support/fakes/_apex_common``."""

from apex._common.normalization import FusedLayerNorm, FusedRMSNorm

__all__ = ["FusedLayerNorm", "FusedRMSNorm"]
