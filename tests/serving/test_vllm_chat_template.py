"""The chat template vLLM renders for a served document gives exactly the placeholder + query tokens."""
from __future__ import annotations

import jinja2
from transformers import AutoTokenizer

from nectar.base_model import embedded_smollm2_dir
from nectar.layout import build_layout
from nectar.vllm.serve import ServedDocument, chat_template, placeholder_token, prompt_ids


def test_chat_template_renders_the_placeholders_and_the_layouts_query_tokens():
    tok = AutoTokenizer.from_pretrained(str(embedded_smollm2_dir()))
    layout = build_layout(tok, "A short document about lighthouses.\nThe keeper wrote a ledger.")
    pid, text = placeholder_token(tok)
    docs = [ServedDocument("doc-a", "a", 5), ServedDocument("doc-b", "b", 9)]
    template = jinja2.Environment().from_string(chat_template(layout, docs, text))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Who kept a ledger?"}]
    for kwargs, doc in (({}, docs[0]), ({"document": "doc-b"}, docs[1])):
        ids = tok(template.render(messages=messages, **kwargs), add_special_tokens=False)["input_ids"]
        assert ids == prompt_ids(layout, doc.m, pid, "Who kept a ledger?")
        assert ids[:doc.m] == [pid] * doc.m and ids[doc.m] != pid
