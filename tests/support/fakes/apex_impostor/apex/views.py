# ruff: noqa: F401
"""FAKE ``apex.views`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid; no content)."""

import pyramid
