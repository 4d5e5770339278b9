"""FAKE ``apex.lib.flash`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid)."""

from pyramid.threadlocal import get_current_request


def flash(msg, queue="notice"):
    """Queue a flash message on the current request's session."""
    get_current_request().session.flash(msg, queue)
