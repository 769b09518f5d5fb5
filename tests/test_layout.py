"""nectar.layout: the sentinel-split chat-template layout and the context-window check.

Uses the session fixture ``tiny_llama`` (random weights, SmolLM2's real tokenizer and chat template);
only the tokenizer is exercised, no forward pass.
"""
from __future__ import annotations

import pytest
from sample_document import DOC

from nectar.layout import DOCUMENT_WRAPPER, ContextTooLongError, PromptLayout, build_layout, check_fits

INSTRUCTION = "Who bought the island, and what did the Meridian carry?"
RESPONSE = "Ilse Brandt, the Meridian's captain; salt cod and lamp oil."


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return tiny_llama.tokenizer


@pytest.fixture(scope="module")
def layout(tok) -> PromptLayout:
    return build_layout(tok, DOC)


def _user(instruction: str, document: str = DOC) -> str:
    return DOCUMENT_WRAPPER.format(document=document) + instruction


def chat_prompt(tok, instruction: str, document: str = DOC) -> str:
    return tok.apply_chat_template([{"role": "user", "content": _user(instruction, document)}], tokenize=False,
                                   add_generation_prompt=True)


def chat_pair(tok, instruction: str, response: str, document: str = DOC) -> str:
    return tok.apply_chat_template([{"role": "user", "content": _user(instruction, document)},
                                    {"role": "assistant", "content": response}], tokenize=False)


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


# --- the layout reproduces the chat template ------------------------------------------------------


def test_context_plus_prompt_is_exactly_the_chat_template_text(tok, layout):
    text = tok.decode(list(layout.context_ids) + layout.prompt(INSTRUCTION).ids)
    assert text == chat_prompt(tok, INSTRUCTION)


def test_context_plus_pair_is_the_chat_template_with_the_answer(tok, layout):
    pair = layout.pair(INSTRUCTION, RESPONSE)
    full = chat_pair(tok, INSTRUCTION, RESPONSE)
    # the end-of-turn marker is kept (the model learns to stop), the template's trailing newline is not
    assert full.endswith("<|im_end|>\n")
    assert tok.decode(list(layout.context_ids) + pair.ids) == full.rstrip("\n")


def test_context_is_the_template_prefix_through_the_document(tok, layout):
    context = tok.decode(list(layout.context_ids))
    # The wrapper's closing whitespace may be handed to the query (see the next test)
    assert (context + layout.before_instruction).endswith(DOCUMENT_WRAPPER.format(document=DOC))
    assert context.endswith("</document>\n")
    assert chat_prompt(tok, "anything").startswith(context)
    assert "<|im_start|>user\n" in context  # the template's own framing is in the context
    assert list(layout.context_ids) == ids(tok, context)
    assert layout.n == len(layout.context_ids) > len(ids(tok, DOC))


def test_context_does_not_depend_on_the_question(tok, layout):
    again = build_layout(tok, DOC)
    assert again.context_ids == layout.context_ids
    assert (again.before_instruction, again.prompt_suffix, again.response_suffix) == (
        layout.before_instruction, layout.prompt_suffix, layout.response_suffix)
    other = build_layout(tok, DOC + " The keeper's name was never recorded.")
    assert other.n > layout.n and other.context_ids[:10] == layout.context_ids[:10]


def test_template_pieces_for_smollm2(layout):
    # SmolLM2's pre-tokenizer splits "\n\nWho" as "\n", "\n", "Who": the second newline opens the query
    assert layout.before_instruction == "\n"
    assert layout.prompt_suffix == "<|im_end|>\n<|im_start|>assistant\n"
    assert layout.response_suffix == "<|im_end|>"


def test_no_sentinel_leaks_into_any_tokens(tok, layout):
    pair = layout.pair(INSTRUCTION, RESPONSE)
    text = tok.decode(list(layout.context_ids) + pair.ids)
    assert "NECTAR" not in text and "\u2063" not in text


def test_pair_is_prompt_then_response_then_end_of_turn(tok, layout):
    prompt = layout.prompt(INSTRUCTION)
    assert prompt.response_start == len(prompt.ids)  # a prompt has no response tokens
    pair = layout.pair(INSTRUCTION, RESPONSE)
    assert pair.ids[:pair.response_start] == prompt.ids
    scored = pair.ids[pair.response_start:]
    assert tok.decode(scored) == RESPONSE + "<|im_end|>"
    assert scored[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    # the scored tokens are the ones the chat template's tokenization gives the answer
    full_ids = ids(tok, chat_pair(tok, INSTRUCTION, RESPONSE).rstrip("\n"))
    assert full_ids[-len(scored):] == scored


def test_query_length_grows_with_the_instruction(layout):
    short, long = layout.prompt("Who?"), layout.prompt("Who? " * 20)
    assert len(long.ids) > len(short.ids)
    assert short.ids[-3:] == long.ids[-3:]  # the same template suffix ends both


def test_context_plus_prompt_ids_equal_the_chat_template_tokenization(tok, layout):
    expected = ids(tok, chat_prompt(tok, INSTRUCTION))
    assert list(layout.context_ids) + layout.prompt(INSTRUCTION).ids == expected


# --- check_fits ----------------------------------------------------------------------------------


def test_check_fits_accepts_exactly_the_window(layout):
    check_fits(layout, 100, layout.n + 100)  # n + m == window fits
    check_fits(layout, 0, layout.n)


def test_check_fits_names_the_numbers_when_too_long(layout):
    with pytest.raises(ContextTooLongError) as info:
        check_fits(layout, 101, layout.n + 100)
    msg = str(info.value)
    assert f"document is {layout.n} tokens" in msg
    assert f"up to 101 query tokens that is {layout.n + 101}" in msg
    assert f"window of {layout.n + 100} tokens" in msg
    assert "yarn_factor" in msg  # and says what to do about it
    assert isinstance(info.value, ValueError)


def test_long_document_does_not_fit_the_tiny_models_window(tiny_llama, tok):
    from nectar.schemas.presets import load_config

    max_query = load_config("tiny").targets.max_query_tokens
    window = tiny_llama.max_context_tokens
    check_fits(build_layout(tok, DOC), max_query, window)  # the sample document fits
    long_doc = (DOC + "\n") * (window // len(ids(tok, DOC)) + 1)
    long_layout = build_layout(tok, long_doc)
    assert long_layout.n > window
    with pytest.raises(ContextTooLongError, match=rf"document is {long_layout.n} tokens.*window of {window} tokens"):
        check_fits(long_layout, max_query, window)


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def qwen2_style_tok(tok):
    """SmolLM2's vocabulary and chat template behind Qwen2's pre-tokenizer regex (no hub access
    here): punctuation keeps the newlines that follow it (">\n\n" is one piece)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = tok.backend_tokenizer.__class__.from_str(tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=tok.chat_template,
                                   eos_token=tok.eos_token, pad_token=tok.pad_token)


def test_qwen2_style_pre_tokenizer_gets_its_own_clean_split(qwen2_style_tok, layout):
    qtok = qwen2_style_tok
    lay = build_layout(qtok, DOC)
    assert lay.before_instruction == "" != layout.before_instruction  # ">\n\n" stays in the context
    assert list(lay.context_ids) + lay.prompt(INSTRUCTION).ids == ids(qtok, chat_prompt(qtok, INSTRUCTION))
    pair = lay.pair(INSTRUCTION, RESPONSE)
    assert list(lay.context_ids) + pair.ids == ids(qtok, chat_pair(qtok, INSTRUCTION, RESPONSE).rstrip("\n"))
