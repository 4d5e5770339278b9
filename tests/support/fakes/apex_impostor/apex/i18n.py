"""FAKE ``apex.i18n`` of the PyPI Pyramid toolkit ``apex`` (needs pyramid)."""

from pyramid.i18n import TranslationStringFactory

MessageFactory = TranslationStringFactory("Apex")
