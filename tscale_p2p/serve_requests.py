"""The completion server's request bodies: parsed with pydantic's JSON parser, checked by pydantic models.

A body is untrusted bytes. `parse_json` refuses what is not plain JSON (NaN, lone surrogates, integers of
thousands of digits, nesting hundreds deep) with a `RequestError`; `parse_completion_request` and
`parse_chat_request` check its fields' types with the strict models below (no "12" for 12, no true for 1) and
hand the values to `SamplingParams`, which checks their ranges. Every refusal names the bad field.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tscale_p2p.chat import TURN_STARTS, render_transcript
from tscale_p2p.errors import UserError
from tscale_p2p.generate import TOKENIZER, GenerationSequence, SamplingParams

MAX_SEQUENCES_PER_REQUEST = 64
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Fields of OpenAI's completion request that change the result and that we do not implement: refused
# unless they hold their neutral value, rather than silently ignored.
_UNSUPPORTED = {"logprobs": None, "suffix": None, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
                "logit_bias": {}}
# The same for /v1/chat/completions (OpenAI's chat requests have boolean logprobs, tools, formats; a tool_choice
# without tools changes nothing, so it passes).
_UNSUPPORTED_CHAT = {"logprobs": False, "top_logprobs": None, "presence_penalty": 0, "frequency_penalty": 0,
                     "logit_bias": {}, "tools": [], "functions": [], "response_format": {"type": "text"}}
_SHOWN = reprlib.Repr()  # a bad value quoted in an error, kept short (Python 3.11's Repr takes no arguments)
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlong = 40


class RequestError(Exception):
    """A request we refuse: HTTP status, message, and the offending parameter when there is one."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class _Body(BaseModel):
    """Fields both endpoints share. null means "the default", as OpenAI's clients send it. Each field's
    description completes the sentence "FIELD must be ..." of its error."""

    model_config = ConfigDict(strict=True, extra="ignore")  # other OpenAI fields (user, ...) change nothing here

    n: int | None = Field(None, ge=1, description="an integer >= 1")
    max_tokens: int | None = Field(None, description="an integer")
    temperature: float | None = Field(None, description="a number")
    top_k: int | None = Field(None, description="an integer")
    top_p: float | None = Field(None, description="a number")
    seed: int | None = Field(None, description="an integer")
    stop: str | list[str] | None = Field(None, description="a string or a list of strings")
    stream: bool | None = Field(None, description="true or false")
    stream_options: _StreamOptions | None = Field(None, description="an object")


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool | None = Field(None, description="true or false")


_Body.model_rebuild()


class _CompletionBody(_Body):
    prompt: str | list[str] = Field(min_length=1, description="a string or a non-empty list of strings")
    echo: bool | None = Field(None, description="true or false")


class _ChatBody(_Body):
    messages: Any = None  # checked by `render_transcript` (its own models), whose errors name the message
    max_completion_tokens: int | None = Field(None, description="an integer")  # max_tokens' newer name


@dataclass
class CompletionRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` body: choice i completes prompts[i // n]."""

    prompts: list[str]
    n: int
    params: SamplingParams
    stream: bool
    echo: bool
    chat: bool = False  # answer in the chat shape (messages and deltas instead of text)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts

    def sequences(self, tokenizer=TOKENIZER) -> list[GenerationSequence]:
        """One sequence per choice, its prompt in `tokenizer`'s tokens (the model's: usage counts those)."""
        seqs = []
        for prompt in self.prompts:
            for j in range(self.n):
                params = self.params
                if params.seed is not None and j:  # n choices of one seeded request differ, reproducibly
                    params = SamplingParams(**{**params.__dict__, "seed": params.seed + j})
                seqs.append(GenerationSequence(prompt, params, tokenizer))
        return seqs


def parse_json(raw: bytes) -> object:
    """The JSON value of a request body; RequestError (400) for anything but strict JSON."""
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as error:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON: {error}") from None


def parse_completion_request(body: object, model_id: str) -> CompletionRequest:
    """Check a decoded ``/v1/completions`` body; raise `RequestError` naming the first bad field."""
    fields = _validated(_CompletionBody, body, model_id, _UNSUPPORTED)
    prompts = [fields.prompt] if isinstance(fields.prompt, str) else fields.prompt
    return _request(fields, prompts, _or(fields.max_tokens, DEFAULT_MAX_TOKENS), (), echo=bool(fields.echo))


def parse_chat_request(body: object, model_id: str, context: int) -> CompletionRequest:
    """Check a decoded ``/v1/chat/completions`` body; its messages become one transcript prompt. Without
    max_tokens (or its newer name max_completion_tokens) the reply may run to the model's `context`."""
    fields = _validated(_ChatBody, body, model_id, _UNSUPPORTED_CHAT)
    try:
        prompt = render_transcript(fields.messages)
    except UserError as error:
        raise RequestError(HTTPStatus.BAD_REQUEST, str(error), "messages") from None
    max_tokens = _or(fields.max_tokens, _or(fields.max_completion_tokens, context))
    return _request(fields, [prompt], max_tokens, TURN_STARTS, echo=False, chat=True)


def _validated(model: type[_Body], body: object, model_id: str, unsupported: dict) -> Any:
    if not isinstance(body, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != model_id:
        raise RequestError(
            HTTPStatus.NOT_FOUND, f"model {_SHOWN.repr(name)} does not exist; this server has {model_id!r}",
            "model", "model_not_found",
        )
    for field, neutral in unsupported.items():
        if body.get(field, neutral) not in (neutral, None):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{field} is not supported by this server", field)
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _field_error(model, body, error.errors()[0]) from None


def _field_error(model: type[_Body], body: dict, error: dict) -> RequestError:
    """'FIELD must be WHAT, got VALUE' for pydantic's first error (a nested field as stream_options.include_usage)."""
    path, value, what = [], body, "valid"
    for part in error["loc"]:  # field names, then pydantic's names of union members and list indexes
        info = model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        if info is None:
            break
        path.append(part)
        value = value.get(part) if isinstance(value, dict) else None
        what = info.description or what
        model = next((kind for kind in getattr(info.annotation, "__args__", ())
                      if isinstance(kind, type) and issubclass(kind, BaseModel)), None)
    shown = "nothing" if error["type"] == "missing" else _SHOWN.repr(value)
    return RequestError(HTTPStatus.BAD_REQUEST, f"{'.'.join(path)} must be {what}, got {shown}", path[0])


def _request(fields: _Body, prompts: list[str], max_tokens: int, extra_stop: tuple, echo: bool,
             chat: bool = False) -> CompletionRequest:
    """The request for `prompts` with the other sampling fields (the same for both endpoints)."""
    n = fields.n or 1
    if n * len(prompts) > MAX_SEQUENCES_PER_REQUEST:
        raise RequestError(
            HTTPStatus.BAD_REQUEST,
            f"{n * len(prompts)} completions in one request; at most {MAX_SEQUENCES_PER_REQUEST}", "n",
        )
    stop = () if fields.stop is None else (fields.stop,) if isinstance(fields.stop, str) else tuple(fields.stop)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(fields.temperature, 1.0),
            top_k=_or(fields.top_k, 0),
            top_p=_or(fields.top_p, 1.0),
            seed=fields.seed,
            stop=stop + extra_stop,
        )
    except UserError as error:
        raise RequestError(HTTPStatus.BAD_REQUEST, str(error)) from None
    options = fields.stream_options
    return CompletionRequest(
        prompts=prompts, n=n, params=params, stream=bool(fields.stream), echo=echo, chat=chat,
        include_usage=bool(options and options.include_usage),
    )


def _or(value, default):
    return default if value is None else value
