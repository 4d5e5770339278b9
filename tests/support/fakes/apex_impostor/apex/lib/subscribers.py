# ruff: noqa: F401
"""FAKE ``apex.lib.subscribers`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid)."""

import pyramid
