# ruff: noqa: F401
"""FAKE ``apex.lib.form`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid; no content)."""

import pyramid
