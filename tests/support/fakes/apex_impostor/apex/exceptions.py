"""FAKE ``apex.exceptions`` of the PyPI Pyramid toolkit ``apex`` (unreachable: the package's
``__init__`` fails first without pyramid_mailer)."""


class MessageException(Exception):
    message = ""

    def __init__(self, message=None):
        super().__init__(message or self.message)


class ApexAuthSecret(MessageException):
    message = "apex.auth_secret is not configured"


class ApexSessionSecret(MessageException):
    message = "apex.session_secret is not configured"
