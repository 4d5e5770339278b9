"""FAKE ``apex.ext`` of the PyPI Pyramid toolkit ``apex``."""
