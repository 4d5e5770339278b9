"""A plugin whose import fails, as one with a missing dependency does."""

import distkit_test_no_such_backend  # noqa: F401  (missing on purpose)
