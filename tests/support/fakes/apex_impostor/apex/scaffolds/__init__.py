# ruff: noqa: F401
"""FAKE ``apex.scaffolds`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid.scaffolds)."""

from pyramid.scaffolds import PyramidTemplate
