"""The error a request handler raises for input the client got wrong."""


class UserError(Exception):
    """A request the client got wrong; reported in the future's result (or as a 400) as category ``user``."""
