"""One error taxonomy for every Reame process.

Each error kind knows its OpenAI error `type` and HTTP status so that the gateway maps
errors in one place, and the CLI prints `error.message` as one clear line.
"""
from __future__ import annotations


class ReameError(Exception):
    """Base of every error Reame reports to a person or a client."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init_subclass__(cls, *, status: int | None = None, type: str | None = None,
                          code: str | None = None, **kwargs):
        """A kind's OpenAI fields as class keywords: `class X(ReameError, status=404, code="...")`."""
        super().__init_subclass__(**kwargs)
        for name, value in (("status", status), ("type", type), ("code", code)):
            if value is not None:
                setattr(cls, name, value)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


class ConfigError(ReameError, type="configuration_error"):
    """reame.conf or a command-line flag is wrong; raised at start-up."""


class ModelLoadError(ReameError, type="model_error"):
    """A model file is missing, not GGUF, truncated or uses something we do not support."""


class ModelFetchError(ReameError, type="model_error"):
    """A model could not be downloaded, assembled or verified."""


class InvalidRequestError(ReameError, status=400, type="invalid_request_error"):
    """The caller sent something we cannot serve (bad ids, bad parameters, too long)."""


class ContextLengthError(InvalidRequestError, code="context_length_exceeded"):
    pass


class TokenizerError(ReameError, type="tokenizer_error"):
    """The tokenizer or chat template in the GGUF cannot be built or rendered."""
