# ruff: noqa: F401
"""FAKE ``apex.models`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid; no content)."""

import pyramid
