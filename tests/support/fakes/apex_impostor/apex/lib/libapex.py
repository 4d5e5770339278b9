# ruff: noqa: F401
"""FAKE ``apex.lib.libapex`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid; no content)."""

import pyramid
