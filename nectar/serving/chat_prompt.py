"""OpenAI chat messages → the query tokens the module-plugged model reads, as ``nectar ask`` builds them.

The layout (docs/design.md §3) puts the document inside the FIRST user turn of the model's chat template:

    context (the module stands in for it) = system prompt … user turn: "…<document>…</document>"
    query   (positions n, n+1, …)         = first question, end of turn, assistant header …

What that allows:
* one user message — exactly ``layout.prompt(question)``, the tokens the module was trained on;
* a conversation user, assistant, user, … ending with a user turn — every later turn comes after
  the document, so it is a longer query in the same template. (The module was trained on one-turn
  queries; later turns are further from its training distribution, but the arithmetic is exact.)
What it cannot do, refused with a 400 that says why:
* a system/developer message — the system prompt is rendered BEFORE the document, inside the
  context the module replaces, so it cannot be changed per request;
* a conversation that starts with an assistant turn or does not alternate, or that ends with an
  assistant turn (no continuation of a partial answer), tool turns, non-text content.
"""
from __future__ import annotations

from ..layout import DOCUMENT_WRAPPER, PromptLayout
from .errors import ApiError
from .openai_schemas import ChatMessage

# Marks where the first question starts in a rendered conversation (never appears in real text).
_FIRST_QUESTION = "\u2063NECTAR_SERVE_QUESTION\u2063"


def _refuse(message: str, param: str = "messages") -> ApiError:
    return ApiError(400, message, code="unsupported_conversation", param=param)


def message_text(msg: ChatMessage, index: int) -> str:
    if isinstance(msg.content, str):
        return msg.content
    if msg.content is None:
        raise _refuse(f"messages[{index}] ({msg.role}) has no text content; tool calls are not supported")
    parts = []
    for part in msg.content:
        if part.get("type") != "text":
            raise _refuse(f"messages[{index}]: content part type {part.get('type')!r} is not supported; "
                          "the module answers text only")
        parts.append(str(part.get("text", "")))
    return "\n".join(parts)


def conversation(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(role, text) turns, checked: user, assistant, user, …, user."""
    turns = []
    for i, msg in enumerate(messages):
        if msg.role in ("system", "developer"):
            raise _refuse(f"messages[{i}]: {msg.role} messages are not supported: the system prompt sits "
                          "before the document, inside the context the module replaces; put instructions "
                          "in the user message")
        if msg.role not in ("user", "assistant"):
            raise _refuse(f"messages[{i}]: role {msg.role!r} is not supported (only user and assistant)")
        want = "user" if i % 2 == 0 else "assistant"
        if msg.role != want:
            raise _refuse(f"messages[{i}] is a {msg.role} message where a {want} message belongs: the "
                          "conversation must alternate user, assistant, user, … starting with the user")
        if msg.role == "assistant" and getattr(msg, "tool_calls", None):
            raise _refuse(f"messages[{i}]: tool calls are not supported")
        turns.append((msg.role, message_text(msg, i)))
    if turns[-1][0] != "user":
        raise _refuse("the last message must be a user message (continuing an assistant turn is not supported)")
    if not turns[-1][1].strip():
        raise _refuse(f"messages[{len(turns) - 1}]: the question is empty")
    return turns


class ChatPrompt:
    """Renders checked conversations into query token ids for one run's layout."""

    def __init__(self, layout: PromptLayout, tokenizer):
        self.layout, self.tokenizer = layout, tokenizer

    def ids(self, messages: list[ChatMessage]) -> list[int]:
        turns = conversation(messages)
        if len(turns) == 1:
            return list(self.layout.prompt(turns[0][1]).ids)  # exactly `nectar ask`
        return self.multi_turn_ids(turns)

    def multi_turn_ids(self, turns: list[tuple[str, str]]) -> list[int]:
        # Render the whole conversation with the model's template, the document's wrapper in the first
        # user turn as the layout has it, and keep what follows the first question's start: the
        # template around every later turn is the model's own. The layout's query part begins with
        # the whitespace it took from the end of the context (``before_instruction``).
        first = DOCUMENT_WRAPPER.format(document="") + _FIRST_QUESTION + turns[0][1]
        chat = [{"role": "user", "content": first}] + [{"role": r, "content": t} for r, t in turns[1:]]
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        tail = text.split(_FIRST_QUESTION, 1)[1]
        return list(self.tokenizer(self.layout.before_instruction + tail, add_special_tokens=False)["input_ids"])
