"""The one exception type Ingot raises for bad input."""


class IngotError(Exception):
    """Bad input: a file that is not what it claims, a shape that does not fit, an op a backend lacks.

    The message is one sentence naming the op, file or field and the values involved.
    """
