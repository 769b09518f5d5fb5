"""The prompt layout (docs/design.md §3): a fixed document prefix and a per-pair query part.

The model's own chat template is rendered with sentinels where the instruction and response go and
split there, so the context/query boundary is identical for every pair and every model:

    context = template prefix … <document text>         n tokens, positions 0 … n-1, tokenized once
    query   = instruction + template + response         m tokens, positions n … n+m-1

The two parts are tokenized separately and concatenated; every stage (verification, targets,
training, evaluation) goes through this module, so the token sequence is the same everywhere. The
split point is moved within the whitespace that ends the context until the two parts tokenize
exactly as the whole chat would (``_clean_split``), so the query tokens are the model's own.
"""
from __future__ import annotations

from dataclasses import dataclass

DOCUMENT_WRAPPER = (
    "Answer the instruction after this document using the document.\n\n"
    "<document>\n{document}\n</document>\n\n"
)
_QUERY = "\u2063NECTAR_QUERY\u2063"
_INSTR = "\u2063NECTAR_INSTRUCTION\u2063"
_RESP = "\u2063NECTAR_RESPONSE\u2063"


class ContextTooLongError(ValueError):
    """The document plus the longest query does not fit the model's window."""


@dataclass(frozen=True)
class QueryTokens:
    ids: list[int]
    response_start: int  # index in ids of the first response token (== len(ids) for prompts)


@dataclass(frozen=True)
class PromptLayout:
    context_ids: tuple[int, ...]
    before_instruction: str  # template text between the document and the instruction
    prompt_suffix: str  # template text between the instruction and the response
    response_suffix: str  # template text after the response (end-of-turn)
    tokenizer: object

    @property
    def n(self) -> int:
        return len(self.context_ids)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, instruction: str) -> QueryTokens:
        """Query tokens up to the start of the assistant's answer (for generation)."""
        ids = self._encode(self.before_instruction + instruction + self.prompt_suffix)
        return QueryTokens(ids=ids, response_start=len(ids))

    def pair(self, instruction: str, response: str) -> QueryTokens:
        """Query tokens of a full pair; the response (and its end-of-turn) is what gets scored."""
        head = self.prompt(instruction).ids
        tail = self._encode(response + self.response_suffix)
        return QueryTokens(ids=head + tail, response_start=len(head))


def build_layout(tokenizer, document: str) -> PromptLayout:
    """Render the chat template around ``document`` and split it at the sentinels."""
    user = DOCUMENT_WRAPPER.format(document=document) + _QUERY + _INSTR
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}, {"role": "assistant", "content": _RESP}], tokenize=False
    )
    gen = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                        add_generation_prompt=True)
    context_text, rest = full.split(_QUERY, 1)
    before_instruction, rest = rest.split(_INSTR, 1)
    _, response_suffix = rest.split(_RESP, 1)
    prompt_suffix = gen.split(_INSTR, 1)[1]
    # Templates end turns with e.g. "<|im_end|>\n"; the model should learn to stop at the marker.
    response_suffix = response_suffix.rstrip("\n")
    k = _clean_split(tokenizer, context_text, before_instruction, prompt_suffix)
    if k:
        context_text, before_instruction = context_text[:-k], context_text[-k:] + before_instruction
    ids = tuple(tokenizer(context_text, add_special_tokens=False)["input_ids"])
    return PromptLayout(ids, before_instruction, prompt_suffix, response_suffix, tokenizer)


# Typical first words of instructions, to find where the context can end without changing how the
# tokenizer would have split the whole chat.
_PROBES = ("What", "Summarize", "Quote", "How many", '"The', "1.")


def _clean_split(tokenizer, context_text: str, before_instruction: str, prompt_suffix: str) -> int:
    """How many trailing whitespace characters of the context to hand to the query so that
    tokenizing the two parts apart gives the same ids as tokenizing the chat in one piece.

    Pre-tokenizers differ at the boundary: SmolLM2's (GPT-2 style) splits "\n\nWhat" into
    "\n", "\n", "What", so a context ending in "\n\n" would end in a "\n\n" token the model never
    sees before a word; Qwen2's keeps ">\n\n" together, so there the split after "\n\n" is the
    clean one. Only the boundary matters, so a short tail of the context is enough to test.
    """
    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    tail = context_text[-64:]
    trailing = len(tail) - len(tail.rstrip())
    for k in range(trailing + 1):
        head, moved = (tail[:-k], tail[-k:]) if k else (tail, "")
        if all(enc(head) + enc(moved + before_instruction + p + prompt_suffix)
               == enc(head + moved + before_instruction + p + prompt_suffix) for p in _PROBES):
            return k
    return 0


def check_fits(layout: PromptLayout, max_query_tokens: int, window: int) -> None:
    total = layout.n + max_query_tokens
    if total > window:
        raise ContextTooLongError(
            f"document is {layout.n} tokens; with up to {max_query_tokens} query tokens that is {total}, "
            f"over the model's window of {window} tokens. Use a shorter document, a model with a longer "
            "window, or enable RoPE scaling (model.yarn_factor=F multiplies the window by F; Qwen3: "
            "model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 32768})."
        )
