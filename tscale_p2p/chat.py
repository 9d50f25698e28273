"""Chat messages, as OpenAI's ``/v1/chat/completions`` sends them, rendered as a plain transcript.

Our models are base models with no chat template, so a conversation becomes the text a base model continues
naturally: one ``Role: content`` turn per line and an open ``Assistant:`` turn at the end. The reply ends where
the model starts a new turn (`TURN_STARTS` are added to the request's stop strings).
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tscale_p2p.errors import UserError

# OpenAI's "developer" role is its newer name for "system".
ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
TURN_STARTS = ("\nUser:", "\nAssistant:", "\nSystem:")


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn of OpenAI's chat request; other fields of a message (name, ...) change nothing here."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal[tuple(ROLE_NAMES)]
    content: str | Annotated[list[_TextPart], Field(min_length=1)]

    def text(self) -> str:
        """A string, or its text parts joined by newlines (as vLLM joins them)."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


_MESSAGES = TypeAdapter(Annotated[list[ChatMessage], Field(min_length=1)])


def render_transcript(messages: object) -> str:
    """The transcript of `messages` (a list of ``{"role", "content"}``) ending in an open assistant turn;
    UserError naming the first bad message."""
    try:
        turns = _MESSAGES.validate_python(messages)
    except ValidationError as error:
        deepest = max((e["loc"] for e in error.errors()), key=len)  # of a union's errors, the most specific
        raise UserError(_message_error(messages, deepest)) from None
    return "\n".join(f"{ROLE_NAMES[turn.role]}: {turn.text()}" for turn in turns) + "\nAssistant:"


def _message_error(messages: object, loc: tuple) -> str:
    """What is wrong where pydantic's first error points: (i, field, union member, j, ...)."""
    if len(loc) < 2:
        if not loc:
            return "messages must be a non-empty list of {role, content} objects"
        return f"messages[{loc[0]}] must be an object with a role and a content"
    i, field = loc[0], loc[1]
    message = messages[i]
    if field == "role":
        role = reprlib.repr(message.get("role"))
        return f"messages[{i}].role {role} is not supported; use one of {', '.join(ROLE_NAMES)}"
    content = message.get("content")
    if len(loc) >= 4 and isinstance(content, list) and content and isinstance(loc[3], int):
        j = loc[3]
        kind = content[j].get("type") if isinstance(content[j], dict) else None
        return f"messages[{i}].content[{j}]: only text parts are supported, got {reprlib.repr(kind)}"
    return f"messages[{i}].content must be a string or a non-empty list of text parts"
