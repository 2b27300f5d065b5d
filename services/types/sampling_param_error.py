"""The error of a bad sampling value, on its own so that the types that check such values
(``SamplingParams``, ``StructuredOutputsParams``) can share it without importing each other."""


class SamplingParamError(ValueError):
    """A bad sampling value; ``param`` names the field, and the message starts with it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
