"""Streaming text from token ids: no half characters, stop strings found across deltas, and
the deltas adding up to the text of the whole output."""
import random

import pytest

from nanovllm.entrypoints.detokenizer import REPLACEMENT, TextStream

# Multi-byte characters (2, 3 and 4 bytes in UTF-8): the byte-level tokenizer splits each
# over several tokens.
TEXT = "The café served crème brûlée, 日本の茶 and 🍵 tea; naïve señor 😀!"


@pytest.fixture(scope="module")
def tokenizer(chat_checkpoint):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(chat_checkpoint)


def stream(tokenizer, token_ids, stop=(), step=1, stop_token=False):
    """Feeds the ids `step` at a time; the deltas and whether a stop string ended the output."""
    text, deltas = TextStream(tokenizer, list(stop)), []
    for start in range(0, len(token_ids), step):
        final = start + step >= len(token_ids)
        delta, stopped = text.add(token_ids[start:start + step], final=final, stop_token=stop_token and final)
        deltas.append(delta)
        if stopped:
            return deltas, True, text.text
    return deltas, False, text.text


def test_characters_split_over_tokens_are_never_sent_in_halves(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)  # the case under test occurs
    deltas, stopped, text = stream(tokenizer, ids)
    assert not stopped and "".join(deltas) == text == TEXT
    assert all(REPLACEMENT not in delta for delta in deltas)


@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_add_up_to_the_decoded_output_on_random_ids(tokenizer, step):
    """Random ids include byte sequences that never become characters: they must come out as
    the whole-output decode has them, U+FFFD included."""
    rng = random.Random(step)
    for _ in range(30):
        ids = [rng.randrange(2, len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        deltas, _, text = stream(tokenizer, ids, step=step)
        assert "".join(deltas) == text == tokenizer.decode(ids, skip_special_tokens=True)
        assert all(not d.endswith(REPLACEMENT) for d in deltas[:-1] if d), "held-back text was sent"


def test_a_stop_token_is_left_out_of_the_text(tokenizer):
    ids = tokenizer.encode("Hello there")
    deltas, _, text = stream(tokenizer, ids + [ids[0]], stop_token=True)
    assert "".join(deltas) == text == "Hello there"


@pytest.mark.parametrize("stop_len", [1, 2, 3, 5, 8])
def test_stop_strings_are_found_across_deltas_and_never_sent(tokenizer, stop_len):
    ids = tokenizer.encode(TEXT)
    checked = 0
    for start in range(0, len(TEXT) - stop_len, 3):
        stop = TEXT[start:start + stop_len]
        expected = TEXT[:TEXT.index(stop)]
        for step in (1, 2):
            deltas, stopped, text = stream(tokenizer, ids, stop=[stop, "never in the text"], step=step)
            assert stopped and "".join(deltas) == text == expected, (stop, step)
            checked += 1
    assert checked >= 10


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode(TEXT)
    deltas, stopped, text = stream(tokenizer, ids, stop=["tea", "brûlée", "served"])
    assert stopped and text == "The café "
