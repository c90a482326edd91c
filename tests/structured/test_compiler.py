from __future__ import annotations

import pytest

from kvgate.engine.outputs import RequestOutput
from kvgate.errors import GRAMMAR_FAILED, ConstraintUnsatisfiable, InvalidRequest, RequestFailed
from kvgate.server.errors import status_of
from kvgate.server.tracker import check_finish
from kvgate.structured.compiler import GrammarCompiler
from kvgate.structured.spec import (
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from kvgate.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.eos_token_ids, cache_size=2)


def test_a_grammar_compiles_once_and_each_request_gets_its_own_matcher(
    compiler: GrammarCompiler, smollm2_tokenizer: Tokenizer
) -> None:
    grammar = regex_grammar("ab+c", "r")
    misses = compiler.misses
    compiler.check(grammar)
    first, second = compiler.matcher(grammar), compiler.matcher(grammar)
    assert compiler.misses == misses + 1 and compiler.hits >= 2
    assert first.consume_tokens(smollm2_tokenizer.encode("abbc", add_special_tokens=False))
    assert first.is_accepting() and not second.is_accepting()  # independent states


def test_the_cache_keeps_only_its_size(compiler: GrammarCompiler) -> None:
    for pattern in ("x1", "x2", "x3"):
        compiler.check(regex_grammar(pattern, "r"))
    misses = compiler.misses
    compiler.check(regex_grammar("x1", "r"))  # dropped: least recently used
    assert compiler.misses == misses + 1


@pytest.mark.parametrize(
    "grammar",
    [
        regex_grammar("(unclosed", "response_format.regex"),
        lark_grammar("start: nowhere", "response_format.grammar"),
        json_schema_grammar({"type": "strin"}, "response_format.json_schema.schema"),
    ],
)
def test_what_does_not_compile_is_a_400_naming_the_field(
    compiler: GrammarCompiler, grammar: object
) -> None:
    with pytest.raises(InvalidRequest) as info:
        compiler.check(grammar)  # type: ignore[arg-type]
    assert info.value.param == grammar.param  # type: ignore[attr-defined]
    assert "does not compile" in info.value.message


def test_output_the_vocabulary_cannot_spell_is_a_400_before_any_work(
    compiler: GrammarCompiler,
) -> None:
    """SmolLM2's vocabulary has no token with the byte 0xF1 (U+40000 is F1 80 80 80):
    llguidance's mask would offer a token its parser then refuses, a 500 mid-decode (found by
    the schema fuzz test). Refused when the grammar is checked; choices it can spell pass."""
    with pytest.raises(InvalidRequest, match="cannot produce") as info:
        compiler.check(choice_grammar(["\U00040000"], "response_format.choice"))
    assert info.value.param == "response_format.choice"
    compiler.check(choice_grammar(["😀 ok", "新"], "response_format.choice"))


def test_output_no_token_can_start_is_a_400_before_any_work(compiler: GrammarCompiler) -> None:
    """Two choices that start with 0xF1 or 0xF2 force no byte, but SmolLM2 has a token for
    neither: llguidance's first mask fails (a 500 in the fuzz test). Refused when checked; a
    choice beside them that can be spelled keeps the grammar valid."""
    with pytest.raises(InvalidRequest, match="cannot be started") as info:
        compiler.check(choice_grammar(["\U00040000", "\U00080000"], "response_format.choice"))
    assert info.value.param == "response_format.choice"
    compiler.check(choice_grammar(["a", "\U00040000"], "response_format.choice"))


def test_a_dead_end_found_mid_decode_is_the_request_s_400() -> None:
    """A grammar whose dead end lies past its start (a choice "0" + U+40000 beside "1") is
    found only when decoding reaches it: the request ends with its error, which the server
    answers as a 400 ``constraint_unsatisfiable`` (the request asked for what this model
    cannot write), not a 500."""
    dead_end = GRAMMAR_FAILED + "Parser Error: token doesn't satisfy the grammar"
    out = RequestOutput("r", (), "", (), True, "error", None, 1, 1, 0, error=dead_end)
    with pytest.raises(ConstraintUnsatisfiable) as info:
        check_finish(out)
    assert status_of(info.value) == (400, "invalid_request_error")
    assert info.value.code == "constraint_unsatisfiable"
    other = RequestOutput("r", (), "", (), True, "error", None, 1, 1, 0, error="a kernel failed")
    with pytest.raises(RequestFailed):
        check_finish(other)
