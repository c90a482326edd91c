"""kvgate.tokenizer.Tokenizer against Hugging Face transformers as the independent reference."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import regex
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvgate.errors import CorruptWeights, InvalidRequest, ModelNotFound
from kvgate.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # 12345 + 678 = 13023\n",
    "x=3.14159; y = 1e-5; id_42 v2.0.1",
    "你好，世界",
    "🤖🎉 emoji, ZWJ 👩‍💻 and flags 🇫🇷",
    "   leading spaces, \t tabs,\n\n\nnewlines   and trailing   ",
    "ends with one space ",
    "café naïve Ünïcödé — “quotes” ‘too’ …",
    "Привет, мир! مرحبا بالعالم שלום",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>kvgate<file_sep>x.py",
    "don't I'm we'll they've she'd IT'S",
    "",
    " ",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 12345 * 2?"},
]


# llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json: Digits, then ByteLevel)
# isolates every \p{N} character before the GPT-2 split. transformers' GGUF loader does not know
# "smollm" and splits GPT-2 style only, which differs in two cases: a run of 2+ whitespace before a
# numeral ("  0": ours "ĠĠ","0"; transformers "Ġ","Ġ","0") and non-ASCII numerals (" ½"). These
# texts are checked against a llama.cpp-style reference instead.
NUMERAL_TEXTS = ["½ ² ①", "x ½y", "Ⅻ chapters", "٣ apples", " 1²3 ", "    return 0", "a\n\n1. b"]


def _transformers_diverges(text: str) -> bool:
    return bool(regex.search(r"\s\s\p{N}", text)) or any(
        unicodedata.category(c).startswith("N") and not c.isascii() for c in text
    )


# llama.cpp's regex_exprs for LLAMA_VOCAB_PRE_TYPE_SMOLLM, applied in turn; unmatched text between
# matches stays a piece of its own (unicode_regex_split).
_SMOLLM_EXPRS = (
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)


def _llama_cpp_style_encode(tok: Tokenizer, text: str) -> list[int]:
    """Independent pre-tokenization (the `regex` module, llama.cpp's expressions), then the BPE
    model alone. No special tokens: meant for plain text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    pieces = [text] if text else []
    for expr in _SMOLLM_EXPRS:
        split: list[str] = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(expr, piece):
                split += [piece[pos : m.start()], m.group()]
                pos = m.end()
            split.append(piece[pos:])
        pieces = [p for p in split if p]
    ids: list[int] = []
    for piece in pieces:
        spelled = "".join(byte_chars[b] for b in piece.encode("utf-8"))
        ids += [t.id for t in tok.backend.model.tokenize(spelled)]
    return ids


def _representable(tok: Tokenizer, text: str) -> bool:
    """Whether every UTF-8 byte of text has a token. SmolLM2's vocabulary lacks a few (0x04,
    0x06, 0x13, 0x14, 0x16, 0x1d, 0xc0, 0xc1, 0xf1, 0xf2, 0xf5..0xff) and has no byte fallback,
    so such characters are dropped, by transformers too."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    return all(tok.backend.token_to_id(byte_chars[b]) is not None for b in text.encode("utf-8"))


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf_path: Path) -> Any:
    """transformers' own tokenizer built from the same GGUF (independent implementation)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name
    )


def _write_tiny_config(directory: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    ).save_pretrained(directory)


# --------------------------------------------------------------------------------- basics


def test_special_tokens_and_metadata(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, (2,))
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.add_bos_token is False
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.id_to_token(10**9) is None
    # GGUF token_type 3 (control): <|endoftext|> .. <empty_output> are ids 0..16.
    assert tok.all_special_ids == frozenset(range(17))
    assert tok.backend.get_vocab_size() == 49152


def test_digits_are_split_individually(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("12345")
    assert [smollm2_tokenizer.id_to_token(i) for i in ids] == list("12345")


def test_add_bos_token_prepends_only_when_asked(smollm2_tokenizer: Tokenizer) -> None:
    tok = Tokenizer(smollm2_tokenizer.backend, bos_token_id=1, eos_token_id=2, add_bos_token=True)
    assert tok.encode("hi") == [1, *smollm2_tokenizer.encode("hi")]
    assert tok.encode("hi", add_special_tokens=False) == smollm2_tokenizer.encode("hi")
    assert smollm2_tokenizer.encode("hi", add_special_tokens=True) == smollm2_tokenizer.encode(
        "hi", add_special_tokens=False
    )


# --------------------------------------------------------------------------------- vs transformers


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_gguf_tokenizer(
    smollm2_tokenizer: Tokenizer, hf_tokenizer: Any, text: str
) -> None:
    ours = smollm2_tokenizer.encode(text)
    assert ours == hf_tokenizer.encode(text, add_special_tokens=True)
    assert smollm2_tokenizer.decode(ours, skip_special_tokens=False) == text
    assert smollm2_tokenizer.decode(ours, skip_special_tokens=True) == hf_tokenizer.decode(
        ours, skip_special_tokens=True
    )


def test_chat_prompt_encodes_like_transformers(
    smollm2_tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    prompt = smollm2_tokenizer.apply_chat_template(CONVERSATION)
    ids = smollm2_tokenizer.encode(prompt)
    assert ids == hf_tokenizer.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 5  # one <|im_start|> per message + generation prompt


@pytest.mark.parametrize("text", [t for t in TEXTS + NUMERAL_TEXTS if "<" not in t])
def test_encode_matches_llama_cpp_style_reference(smollm2_tokenizer: Tokenizer, text: str) -> None:
    assert smollm2_tokenizer.encode(text) == _llama_cpp_style_encode(smollm2_tokenizer, text)


@pytest.mark.parametrize(("text", "ours"), [(" ½", ["Ġ", "Â½"]), ("  0", ["ĠĠ", "0"])])
def test_numerals_split_as_llama_cpp_not_transformers(
    smollm2_tokenizer: Tokenizer, hf_tokenizer: Any, text: str, ours: list[str]
) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert [smollm2_tokenizer.id_to_token(i) for i in ids] == ours
    # Documents the known transformers divergence (GPT-2 splitting: "ĠÂ","½" / "Ġ","Ġ","0").
    assert hf_tokenizer.encode(text) != ids


@settings(max_examples=200, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=40),
        # Dense in what pre-tokenizers treat specially: whitespace runs, contractions, numerals.
        st.text(alphabet=" \t\n\r'sdmtvelrSDA0123456789½²٣.,!-_你🤖", max_size=40),
    )
)
def test_encode_matches_references_on_random_text(
    smollm2_tokenizer: Tokenizer, hf_tokenizer: Any, text: str
) -> None:
    ids = smollm2_tokenizer.encode(text)
    if _representable(smollm2_tokenizer, text):
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text
    assume("<" not in text)  # keep special-token spellings out of the references
    assert ids == _llama_cpp_style_encode(smollm2_tokenizer, text)
    if not _transformers_diverges(text):
        assert ids == hf_tokenizer.encode(text)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(
    "messages",
    [
        CONVERSATION,
        [{"role": "user", "content": "No system message: the template adds one."}],
        [{"role": "user", "content": "你好 🤖"}, {"role": "assistant", "content": ""}],
    ],
)
def test_chat_template_matches_transformers(
    smollm2_tokenizer: Tokenizer,
    hf_tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt)
    assert got == expected


def test_list_of_parts_content_is_joined(smollm2_tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        },
    ]
    # This template concatenates strings, so transformers needs the joined text.
    joined = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "first\nsecond"},
    ]
    expected = hf_tokenizer.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert smollm2_tokenizer.apply_chat_template(parts) == expected


def test_template_features_match_transformers(
    smollm2_tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    """trim/lstrip blocks, loop controls, tojson, bos/eos, as transformers renders them."""
    template = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'tool' %}{% continue %}{% endif %}\n"
        "    {{ m['role'] | upper }}: {{ m['content'] }}{{ eos_token }}\n"
        "    {{ {'n': loop.index, 'text': 'ü<>&'} | tojson }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "tool", "content": "skipped"},
        {"role": "assistant", "content": "b"},
    ]
    ours = Tokenizer(
        smollm2_tokenizer.backend, bos_token_id=1, eos_token_id=2, chat_template=template
    )
    original = hf_tokenizer.chat_template
    try:
        hf_tokenizer.chat_template = template
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    finally:
        hf_tokenizer.chat_template = original
    assert ours.apply_chat_template(messages) == expected


# --------------------------------------------------------------------------------- chat errors


@pytest.mark.parametrize(
    "messages",
    [
        [],
        ["not a dict"],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 42}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
    ],
)
def test_bad_messages_raise_invalid_request(
    smollm2_tokenizer: Tokenizer, messages: list[Any]
) -> None:
    with pytest.raises(InvalidRequest) as info:
        smollm2_tokenizer.apply_chat_template(messages)
    assert info.value.param == "messages"


def test_raise_exception_in_template_is_invalid_request(smollm2_tokenizer: Tokenizer) -> None:
    tok = Tokenizer(
        smollm2_tokenizer.backend,
        chat_template="{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}ok",
    )
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequest, match="first message must be from the user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_no_or_broken_template_is_invalid_request(smollm2_tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="no chat template") as info:
        Tokenizer(smollm2_tokenizer.backend).apply_chat_template([{"role": "user", "content": "x"}])
    assert info.value.param == "messages"
    broken = Tokenizer(smollm2_tokenizer.backend, chat_template="{% for m in messages %}")
    with pytest.raises(InvalidRequest, match="invalid"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


def test_sandbox_blocks_unsafe_access(smollm2_tokenizer: Tokenizer) -> None:
    tok = Tokenizer(smollm2_tokenizer.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequest):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------------- HF directories


@pytest.mark.parametrize("add_bos_token", [False, True])
def test_save_hf_loads_in_transformers(
    smollm2_tokenizer: Tokenizer, tmp_path: Path, add_bos_token: bool
) -> None:
    from transformers import AutoTokenizer

    tok = Tokenizer(
        smollm2_tokenizer.backend,
        bos_token_id=1,
        eos_token_id=2,
        add_bos_token=add_bos_token,
        chat_template=smollm2_tokenizer.chat_template,
    )
    tok.save_hf(tmp_path)
    _write_tiny_config(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.bos_token, hf.eos_token) == ("<|im_start|>", "<|im_end|>")
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text), text
    assert hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    ) == tok.apply_chat_template(CONVERSATION)

    back = Tokenizer.from_hf_dir(tmp_path)
    assert (back.bos_token_id, back.eos_token_id, back.add_bos_token) == (1, 2, add_bos_token)
    assert back.chat_template == tok.chat_template
    assert back.all_special_ids == smollm2_tokenizer.all_special_ids
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text), text


def test_from_hf_dir_reads_optional_files(smollm2_tokenizer: Tokenizer, tmp_path: Path) -> None:
    smollm2_tokenizer.save_hf(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    # The list form of chat_template, and special tokens as AddedToken dicts.
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT"},
    ]
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}
    del config["add_bos_token"]
    config_file.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 5]}))
    # A truncation setting in tokenizer.json must not cut prompts.
    tok_file = tmp_path / "tokenizer.json"
    tok_json = json.loads(tok_file.read_text())
    tok_json["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    tok_file.write_text(json.dumps(tok_json))

    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.chat_template == "DEFAULT"
    assert tok.eos_token_id == 0 and tok.eos_token_ids == (0, 2, 5)
    assert tok.add_bos_token is False  # not stated, and tokenizer.json adds no BOS
    assert tok.encode(TEXTS[0]) == smollm2_tokenizer.encode(TEXTS[0])  # not truncated to 4

    (tmp_path / "chat_template.jinja").write_text("FROM FILE")
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "FROM FILE"


def test_from_hf_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CorruptWeights, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_a_template_that_renders_tools_gets_them_and_the_calls(
    smollm2_tokenizer: Tokenizer,
) -> None:
    template = (
        "{# calls are written <tool_call> #}"
        "{% for t in tools or [] %}TOOL {{ t.function.name + '\\n' }}{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}{{ c.function.arguments }}"
        "{% endfor %}{{ '\\n' }}{% endfor %}"
    )
    tok = Tokenizer(smollm2_tokenizer.backend, chat_template=template)
    assert tok.renders_tools and not smollm2_tokenizer.renders_tools
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "c1"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, tools=tools)
    assert text == (
        'TOOL get_weather\nuser: Weather?\nassistant:  CALL get_weather{"city":"Oslo"}\n'
        "tool: -3 C\n"
    )
    ids = tok.encode_chat(messages, add_generation_prompt=False, tools=tools)
    assert tok.decode(ids, skip_special_tokens=False) == text
