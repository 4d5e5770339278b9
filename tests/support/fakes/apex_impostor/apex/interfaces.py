"""FAKE ``apex.interfaces`` of the PyPI Pyramid toolkit ``apex`` (needs zope.interface)."""

from zope.interface import Interface


class IApex(Interface):
    """Marker interface."""
