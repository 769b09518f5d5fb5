"""Tokens → text with stop strings: nothing sent is ever taken back, and the text ends before the stop."""
from nectar.serving.text_stream import TextStream, _held_back


def tokens(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_held_back_is_the_longest_suffix_that_could_start_a_stop():
    assert _held_back("the end\n", ("\n\nQ",)) == 1
    assert _held_back("the end\n\n", ("\n\nQ",)) == 2
    assert _held_back("abab", ("ababc", "bx")) == 4
    assert _held_back("the end", ("\n\nQ",)) == 0


def test_without_stops_the_deltas_are_the_detokenized_text(tiny_llama):
    tok = tiny_llama.tokenizer
    ids = tokens(tok, "Captain Ilse Brandt bought Varn Island in 1871. ünïcödé ☃")
    ts = TextStream(tok)
    sent = "".join(ts.push(t) for t in ids) + ts.flush()
    assert sent == ts.text == tok.decode(ids, skip_special_tokens=True)
    assert not ts.hit_stop


def test_a_stop_string_split_across_tokens_is_never_sent(tiny_llama):
    tok = tiny_llama.tokenizer
    text = "The keeper rowed out.\n\nQuestion: who? The end."
    ts = TextStream(tok, ("\n\nQuestion", "never"))
    deltas = [ts.push(t) for t in tokens(tok, text)]
    assert ts.hit_stop and "".join(deltas) == ts.text == "The keeper rowed out."
    assert ts.push(tokens(tok, " more")[0]) == "" and ts.flush() == ""


def test_held_back_text_that_turns_out_not_to_stop_is_sent_at_the_end(tiny_llama):
    tok = tiny_llama.tokenizer
    ts = TextStream(tok, ("\n\nQ",))
    deltas = [ts.push(t) for t in tokens(tok, "Seven sailors.\n\n")]
    assert not "".join(deltas).endswith("\n")  # could still become "\n\nQ"
    assert "".join(deltas) + ts.flush() == "Seven sailors.\n\n" and not ts.hit_stop
