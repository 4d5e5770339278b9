# ruff: noqa: F401
"""FAKE ``apex.lib.i18n`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid; no content)."""

import pyramid
