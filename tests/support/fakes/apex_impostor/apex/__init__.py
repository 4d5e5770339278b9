# ruff: noqa: F401, I001
"""FAKE of the unrelated PyPI package ``apex`` 0.9.10dev (a 2013 Pyramid auth toolkit), for tests.

``pip install apex`` does not give NVIDIA apex: it gives "Pyramid toolkit to add Velruse, Flash
Messages, CSRF, ReCaptcha and Sessions" by Chris Davies (MIT), top-level package ``apex``,
installed metadata version ``0.9.10.dev0``. Its ``apex/__init__.py`` begins with
``from pyramid_mailer.interfaces import IMailer`` followed by pyramid, sqlalchemy and its own
submodules, so on a machine without those, *every* import of it fails at that first line::

    import apex            -> ModuleNotFoundError: No module named 'pyramid_mailer'
    from apex import amp   -> the same error (name == "pyramid_mailer", not "apex.amp")
    import apex.amp        -> the same error

while ``importlib.util.find_spec("apex")`` still finds the package. This fake reproduces that
shape (same module names, same first imports, a few of the same public names) without any of its
code. It has no ``amp``, ``parallel``, ``optimizers`` or ``normalization``. Activate with
``tests.support.fakes.use_fake_apex("impostor")``.
"""

from pyramid_mailer.interfaces import IMailer

from apex.i18n import MessageFactory

from sqlalchemy import engine_from_config

from pyramid.authentication import AuthTktAuthenticationPolicy
from pyramid.authorization import ACLAuthorizationPolicy
from pyramid.settings import asbool

from apex.exceptions import ApexAuthSecret, ApexSessionSecret
from apex.lib.flash import flash

__fake_apex__ = "impostor"


def includeme(config):
    """Pyramid ``config.include('apex')`` entry point (the fake never gets this far)."""
    raise NotImplementedError("fake of the PyPI 'apex' Pyramid toolkit")
