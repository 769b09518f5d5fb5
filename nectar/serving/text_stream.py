"""Tokens → text deltas for one answer, with OpenAI's stop strings.

The answer's text must not contain a stop string, and a streamed answer must never send text it
later has to take back. So text that could still turn out to be the start of a stop string is held
back until the next tokens decide it (e.g. with stop "\\n\\nQ", a trailing "\\n" waits). Tokens are
decoded by the incremental ``Detokenizer`` (which also holds back split UTF-8 sequences) that
``nectar ask`` uses too, so the server's text is ``nectar ask``'s text for the same tokens.
"""
from __future__ import annotations

from typing import Callable

TextCallback = Callable[[str], None]


class Detokenizer:
    """Turns a growing token list into text deltas (holding back incomplete UTF-8 sequences)."""

    def __init__(self, tokenizer, callback: TextCallback | None):
        self.tokenizer, self.callback = tokenizer, callback
        self.tokens: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return
        delta, self.emitted = text[len(self.emitted):], text
        if delta and self.callback is not None:
            self.callback(delta)

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """Feed tokens with ``push``; each returns the text now safe to send (maybe ""). ``hit_stop``
    turns true when a stop string appeared (the text ends before it, later tokens are ignored);
    ``flush`` returns what was held back when the answer ends otherwise."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.stops = stops
        self.hit_stop = False
        self._closed = False
        self.text = ""  # everything sent so far: the answer
        self._pending = ""  # decoded, not sent yet (could start a stop string)
        self._detok = Detokenizer(tokenizer, self._decoded)

    def _decoded(self, delta: str) -> None:
        self._pending += delta

    def push(self, token: int) -> str:
        if self._closed:
            return ""
        self._detok.push(token)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the answer: the rest of the text (incl. an incomplete UTF-8 tail, as ``ask``)."""
        if self._closed:
            return ""
        self._pending += self._detok.text()[len(self._detok.emitted):]
        out = self._release(final=True)
        self._closed = True
        return out

    def _release(self, final: bool) -> str:
        # A stop string can only start inside the pending text: anything that could begin one
        # was held back when it was decoded.
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._pending = self._pending[:min(hits)], ""
            self.hit_stop = self._closed = True
        else:
            keep = 0 if final else _held_back(self._pending, self.stops)
            cut = len(self._pending) - keep
            out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return out
