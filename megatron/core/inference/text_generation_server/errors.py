"""Errors a request can get, in OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal of a request goes through :class:`OpenAIError`, so each endpoint (the OpenAI ones and Megatron's
legacy ``PUT /api``) answers bad input the same way: a 4xx status and a body the ``openai`` client turns into
``openai.BadRequestError`` / ``openai.NotFoundError`` with the message, ``param`` and ``code`` intact.
"""

from typing import Any, Dict, Optional

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


class OpenAIError(Exception):
    """A request the server refuses (or failed to serve), with the HTTP status and the error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = INVALID_REQUEST,
        param: Optional[str] = None,
        code: Optional[str] = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: Optional[str] = None, code: Optional[str] = None
) -> Dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_type(param: str, expected: str, value: Any) -> OpenAIError:
    return OpenAIError(
        f"Invalid type for '{param}': expected {expected}, but got {_json_type_name(value)} instead.",
        param=param,
        code="invalid_type",
    )


def below_minimum(param: str, minimum, value) -> OpenAIError:
    return OpenAIError(
        f"Invalid '{param}': {value} is below the minimum value {minimum}. Expected a value >= {minimum}.",
        param=param,
        code="below_min_value",
    )


def above_maximum(param: str, maximum, value) -> OpenAIError:
    return OpenAIError(
        f"Invalid '{param}': {value} is above the maximum value {maximum}. Expected a value <= {maximum}.",
        param=param,
        code="above_max_value",
    )


def missing_parameter(param: str) -> OpenAIError:
    return OpenAIError(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def _json_type_name(value: Any) -> str:
    """The JSON name of a decoded value's type ("a string", "an array", ...), as the messages say it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
