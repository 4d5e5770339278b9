# ruff: noqa: F401
"""FAKE ``apex.decorators`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid; no content)."""

import pyramid
