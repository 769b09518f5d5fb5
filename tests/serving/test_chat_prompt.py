"""Chat messages → query tokens: one question is exactly ``nectar ask``'s prompt, a conversation is
the model's own chat template after the document, and what the layout cannot hold is refused."""
import pytest

from nectar.layout import DOCUMENT_WRAPPER, build_layout
from nectar.serving.chat_prompt import ChatPrompt
from nectar.serving.errors import ApiError
from nectar.serving.openai_schemas import ChatMessage


@pytest.fixture
def chat(tiny_llama, document):
    return ChatPrompt(build_layout(tiny_llama.tokenizer, document), tiny_llama.tokenizer)


def msgs(*turns):
    return [ChatMessage(role=r, content=c) for r, c in turns]


def test_one_question_is_the_nectar_ask_prompt(chat):
    q = "Who bought the island?"
    assert chat.ids(msgs(("user", q))) == chat.layout.prompt(q).ids
    # the general renderer agrees on one turn, so both paths build the same tokens
    assert chat.multi_turn_ids([("user", q)]) == chat.layout.prompt(q).ids
    parts = [ChatMessage(role="user", content=[{"type": "text", "text": q}])]
    assert chat.ids(parts) == chat.layout.prompt(q).ids


def test_a_conversation_is_the_whole_chat_after_the_document(chat, tiny_llama, document):
    tok = tiny_llama.tokenizer
    turns = [("user", "Who bought the island?"), ("assistant", "Captain Ilse Brandt."), ("user", "When was that?")]
    ids = chat.ids(msgs(*turns))
    whole = tok.apply_chat_template(
        [{"role": "user", "content": DOCUMENT_WRAPPER.format(document=document) + turns[0][1]}]
        + [{"role": r, "content": c} for r, c in turns[1:]], tokenize=False, add_generation_prompt=True)
    assert list(chat.layout.context_ids) + ids == tok(whole, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("turns, message", [
    ([("system", "Be brief."), ("user", "Who?")], "system prompt sits before the document"),
    ([("assistant", "Hi."), ("user", "Who?")], "must alternate"),
    ([("user", "Who?"), ("user", "When?")], "must alternate"),
    ([("user", "Who?"), ("assistant", "Ilse")], "last message must be a user message"),
    ([("tool", "{}")], "role 'tool' is not supported"),
    ([("user", "   ")], "the question is empty"),
])
def test_what_the_layout_cannot_hold_is_refused(chat, turns, message):
    with pytest.raises(ApiError, match=message) as err:
        chat.ids(msgs(*turns))
    assert err.value.status == 400


def test_non_text_content_is_refused(chat):
    image = [ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])]
    with pytest.raises(ApiError, match="'image_url' is not supported"):
        chat.ids(image)
