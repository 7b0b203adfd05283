"""Incremental detokenization (multi-byte characters split across tokens), stop-string
search and hold-back."""

from __future__ import annotations

import pytest

from actors.engine.detokenizer import IncrementalDetokenizer, find_stop_string, visible_text


@pytest.fixture(scope="module")
def tokenizer():
    from toolkit.tiny_model import train_tokenizer

    return train_tokenizer()


@pytest.mark.parametrize("text", [
    "Unicode too: café, naïve, über, 東京, привет, مرحبا, emoji 🙂 and accents àéîõü.",
    "東京🙂🙂 x",
    "The quick brown fox jumps over the lazy dog.",
])
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Hello there")
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces) or text.isascii()  # chars split across tokens
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(t) for t in ids]
    assert detok.text == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)  # never emits half a character


def test_flush_emits_an_incomplete_tail(tokenizer):
    ids = tokenizer.encode("東")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in ids[:-1]:
        assert detok.add(t) == ""
    assert detok.flush() == tokenizer.decode(ids[:-1])


def test_skip_leaves_out_the_token_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for t in tokenizer.encode("abc"):
        detok.add(t)
    detok.skip(tokenizer.eos_token_id)
    assert detok.text == "abc"


def test_find_stop_string():
    assert find_stop_string("hello world", 3, ["wor"], False) == ("wor", 6)
    assert find_stop_string("hello world", 3, ["wor"], True) == ("wor", 9)
    # only matches the new characters can complete
    assert find_stop_string("hello world", 1, ["hell"], False) is None
    # the earliest occurrence wins, whatever the list order
    assert find_stop_string("abcdef", 6, ["de", "bc"], False) == ("bc", 1)
    assert find_stop_string("abc", 1, ["x"], False) is None


def test_visible_text_holds_back_a_possible_stop_prefix():
    assert visible_text("hello wo", ["world", "!"], finished=False) == "hell"
    assert visible_text("hello wo", ["world"], finished=True) == "hello wo"
    assert visible_text("hello wo", [], finished=False) == "hello wo"
    assert visible_text("hello", ["!"], finished=False) == "hello"
