# ruff: noqa: F401
"""FAKE ``apex.ext.deform`` of the PyPI Pyramid toolkit ``apex`` (needs colander)."""

import colander
