"""FAKE ``apex.lib`` of the PyPI Pyramid toolkit ``apex``."""
