"""Chat messages, as OpenAI's ``/v1/chat/completions`` sends them, rendered as a plain transcript.

Our models are base models with no chat template, so a conversation becomes the text a base model continues
naturally: one ``Role: content`` turn per line and an open ``Assistant:`` turn at the end. The reply ends where
the model starts a new turn (`TURN_STARTS` are added to the request's stop strings).
"""

from __future__ import annotations

from tscale_p2p.errors import UserError

# OpenAI's "developer" role is its newer name for "system".
ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
TURN_STARTS = ("\nUser:", "\nAssistant:", "\nSystem:")


def render_transcript(messages: object) -> str:
    """The transcript of `messages` (a list of ``{"role", "content"}``) ending in an open assistant turn;
    UserError naming the first bad message."""
    if not isinstance(messages, list) or not messages:
        raise UserError("messages must be a non-empty list of {role, content} objects")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserError(f"messages[{i}] must be an object with a role and a content")
        role = message.get("role")
        if role not in ROLE_NAMES:
            raise UserError(f"messages[{i}].role {role!r} is not supported; use one of {', '.join(ROLE_NAMES)}")
        turns.append(f"{ROLE_NAMES[role]}: {_text_of(message.get('content'), i)}")
    return "\n".join(turns) + "\nAssistant:"


def _text_of(content: object, i: int) -> str:
    """A message's text: a string, or a list of text parts (``{"type": "text", "text": ...}``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise UserError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins them
    raise UserError(f"messages[{i}].content must be a string or a non-empty list of text parts")
