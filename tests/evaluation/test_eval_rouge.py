"""ROUGE-L on textbook cases (Lin 2004; CLRS's LCS example)."""
import pytest

from nectar.evaluation.rouge import lcs_length, rouge_l, rouge_tokens


def test_lcs_textbook_example():
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4  # CLRS 15.4: e.g. BCBA
    assert lcs_length(list("BDCABA"), list("ABCBDAB")) == 4
    assert lcs_length([], list("abc")) == 0 and lcs_length(list("abc"), list("abc")) == 3


def test_rouge_l_lin_2004_examples():
    ref = "police killed the gunman"
    s1 = rouge_l("police kill the gunman", ref)  # LCS "police the gunman"
    assert (s1.precision, s1.recall, s1.f1) == (pytest.approx(0.75), pytest.approx(0.75), pytest.approx(0.75))
    s2 = rouge_l("the gunman kill police", ref)  # LCS "the gunman"
    assert s2.f1 == pytest.approx(0.5)


def test_rouge_l_precision_recall_and_tokens():
    s = rouge_l("The cat sat.", "the cat sat on the mat")
    assert (s.precision, s.recall) == (pytest.approx(1.0), pytest.approx(0.5))
    assert s.f1 == pytest.approx(2 * 0.5 / 1.5)
    assert rouge_tokens("Naming, and BINDING: 4.2.1!") == ["naming", "and", "binding", "4", "2", "1"]
    assert rouge_tokens("Über café_bar") == ["über", "café", "bar"]
    assert rouge_l("", "").f1 == 1.0 and rouge_l("", "words").f1 == 0.0 and rouge_l("a b", "c d").f1 == 0.0
