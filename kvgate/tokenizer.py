"""Text <-> token ids, and chat messages -> prompt text, for the loaded model.

A thin typed wrapper around a ``tokenizers.Tokenizer`` (the Rust backend) that adds what the
backend does not know: which id is BOS/EOS, whether BOS is prepended, and the Jinja chat template.
It is built either from a GGUF file's vocabulary (:meth:`Tokenizer.from_gguf_fields`) or from a
Hugging Face directory (:meth:`Tokenizer.from_hf_dir`), and can write itself back out as the
latter (:meth:`Tokenizer.save_hf`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvgate.errors import CorruptWeights, InvalidRequest, ModelNotFound
from kvgate.hf_files import int_list, read_json_object
from kvgate.token_floor import TokenFloor

#: Characters a tokenizer may drop without a token (controls, soft hyphen, zero-width and
#: byte-order marks): probed once per tokenizer for its token floor.
_INVISIBLE = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0), 0xAD, 0x200B, 0xFEFF)]

__all__ = ["GGUF_PRE_TOKENIZERS", "Tokenizer"]

# llama.cpp token types (``tokenizer.ggml.token_type``).
_TOKEN_TYPE_CONTROL = 3  # special tokens such as <|im_start|>: matched whole, dropped on skip
_TOKEN_TYPE_USER_DEFINED = 4  # added, non-special tokens such as <think>: matched whole, kept

# Split regexes of the llama.cpp pre-tokenizer types we support beyond plain GPT-2.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> Any:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_pre() -> Any:
    # llama.cpp "smollm": every digit on its own, then the GPT-2 byte-level regex (as in the
    # original tokenizer.json of SmolLM/SmolLM2).
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _split_pre(pattern: str) -> Any:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


#: ``tokenizer.ggml.pre`` values :meth:`Tokenizer.from_gguf_fields` understands, each mapped to a
#: factory of the equivalent ``tokenizers`` pre-tokenizer. ``None`` means the key is absent.
GGUF_PRE_TOKENIZERS: dict[str | None, Any] = {
    None: _gpt2_pre,
    "default": _gpt2_pre,
    "gpt2": _gpt2_pre,
    "smollm": _smollm_pre,
    "llama-bpe": lambda: _split_pre(_LLAMA3_SPLIT),
    "llama3": lambda: _split_pre(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_pre(_QWEN2_SPLIT),
}


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids and the chat template.

    ``encode`` never lets the backend's post-processor add tokens; BOS is prepended here, and only
    when ``add_bos_token`` is set, so GGUF and Hugging Face sources behave the same.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        """Wrap ``backend``.

        ``extra_eos_token_ids``: further ids that end generation (e.g. from generation_config.json).
        ``vocab_size``: defaults to the backend's size including added tokens.
        """
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        size = backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size: int = int(vocab_size if vocab_size is not None else size)
        eos = ([] if eos_token_id is None else [eos_token_id]) + list(extra_eos_token_ids)
        # dict.fromkeys: de-duplicate, keep order (the primary EOS first).
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos))
        self._template: jinja2.Template | None = None

    # ----------------------------------------------------------------------------- basic API

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (e.g. for ``decoders.DecodeStream``)."""
        return self._backend

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, or None."""
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The (primary) EOS token's text, or None."""
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    @functools.cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of every special token (control tokens, BOS, EOS); ``decode`` may skip these."""
        ids = {i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self.bos_token_id, *self.eos_token_ids) if i is not None)
        return frozenset(int(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) map to their
        single ids. BOS is prepended only when ``add_special_tokens`` and ``add_bos_token``; a chat
        prompt whose template already writes BOS should pass ``add_special_tokens=False``."""
        ids = _ids(self._backend, text)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped when ``skip_special_tokens``."""
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, id: int) -> str | None:
        """The vocabulary string of ``id`` (byte-level spelling, e.g. ``"Ġthe"``), or None."""
        token: str | None = self._backend.id_to_token(id)
        return token

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes token ``id`` stands for (logprobs report them: one token may be only
        part of a UTF-8 character). Byte-level BPE spells bytes as printable characters;
        SentencePiece uses ``<0xNN>`` byte tokens and "▁" for a space."""
        token = self.id_to_token(id)
        if token is None:
            return b""
        if id in self.all_special_ids:
            return token.encode()
        byte = _BYTE_TOKEN.fullmatch(token)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        if isinstance(self._backend.decoder, decoders.ByteLevel):
            table = _byte_level_decoder()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
        return token.replace("\u2581", " ").encode()

    # ----------------------------------------------------------------------------- chat template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` (OpenAI-style ``{"role", "content"}`` dicts) into prompt text.

        Content may be a string or a list of ``{"type": "text", "text": ...}`` parts; the parts'
        texts are joined with ``"\\n"`` (as vLLM does). Rendering follows Hugging Face
        transformers: sandboxed Jinja with ``trim_blocks``/``lstrip_blocks``, and ``bos_token``,
        ``eos_token``, ``add_generation_prompt``, ``raise_exception`` available to the template.

        Raises:
            InvalidRequest: (``param="messages"``) for a malformed message, a template that rejects
                the conversation, or a model without a chat template.
        """
        template = self._compiled_template()
        normalized = _normalize_messages(messages)
        try:
            return template.render(
                messages=normalized,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as exc:  # the template is untrusted data: any failure is the request's
            raise InvalidRequest(
                f"chat template could not render the messages: {exc}", param="messages"
            ) from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt: the template's text, in which only the template itself
        writes control tokens. A special token's text typed in a message's content
        (``hi<|im_end|>\n<|im_start|>system``) is encoded as plain text, so no user can forge
        a turn; where no content holds one, this is exactly ``encode(apply_chat_template())``.
        """
        normalized = _normalize_messages(messages)
        specials = self._special_strings
        if not any(t in m["content"] for m in normalized for t in specials):
            text = self.apply_chat_template(normalized, add_generation_prompt, tools)
            return self.encode(text, add_special_tokens=False)  # the template writes any BOS
        # Render with a placeholder per content (a fresh nonce: no content can spell one),
        # then encode the template's own text as usual and each content with special-token
        # matching off.
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(normalized)]
        text = self.apply_chat_template(marked, add_generation_prompt, tools)
        ids: list[int] = []
        for j, piece in enumerate(re.split(f"\ue000{nonce}:([0-9]+)\ue001", text)):
            if j % 2 == 0:
                ids += _ids(self._backend, piece) if piece else []
            else:
                content = normalized[int(piece)]["content"]
                ids += _ids(self._plain_backend, content)
        return ids

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders ``tools`` and calls itself in the call format the
        server constrains and reads (``<tool_call>``: Qwen's, Hermes'); otherwise the server
        describes them in text (``structured/tools.py``). A template of another call format
        (Llama 3.1's, Mistral's) would teach the model a format the grammar forbids."""
        template = self.chat_template or ""
        return "tools" in template and "<tool_call>" in template

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Most characters of text one token stands for (its vocabulary spelling is at least
        as long: a byte-level character per byte, ``<0xNN>`` for one byte)."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1)

    @functools.cached_property
    def token_floor(self) -> TokenFloor:
        """The fewest tokens a text can be, from the vocabulary (``token_floor.py``): the
        server's size gate before tokenizing."""
        dropped = [c for c in _INVISIBLE if not self.encode(c, add_special_tokens=False)]
        return TokenFloor.from_vocab(self._backend.get_vocab_size(), self.token_bytes, dropped)

    @functools.cached_property
    def _special_strings(self) -> tuple[str, ...]:
        added = self._backend.get_added_tokens_decoder().values()
        return tuple(tok.content for tok in added if tok.special and tok.content)

    @functools.cached_property
    def _plain_backend(self) -> BackendTokenizer:
        """A copy of the backend that reads special tokens' text as ordinary text."""
        plain = BackendTokenizer.from_str(self._backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def _compiled_template(self) -> jinja2.Template:
        if self._template is not None:
            return self._template
        if not self.chat_template:
            raise InvalidRequest(
                "this model has no chat template; use the completions API with a raw prompt",
                param="messages",
            )
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.chat_template)
        except jinja2.TemplateError as exc:
            raise InvalidRequest(
                f"this model's chat template is invalid: {exc}", param="messages"
            ) from exc
        return self._template

    # ----------------------------------------------------------------------------- constructors

    @classmethod
    def from_gguf_fields(
        cls,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        pre: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> Tokenizer:
        """Build a byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) from GGUF metadata.

        ``tokens``/``merges``/``token_types``: the ``tokenizer.ggml.*`` arrays (merges as
        ``"a b"`` strings). ``pre``: ``tokenizer.ggml.pre``, one of :data:`GGUF_PRE_TOKENIZERS`.
        Control (3) and user-defined (4) tokens become added tokens so they encode whole.

        Raises:
            ValueError: for an unknown ``pre`` type or merges that do not fit the vocabulary;
                the GGUF loader turns it into an error naming the file.
        """
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(f"unsupported tokenizer pre-tokenizer type {pre!r}")
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)  # duplicated strings: the first id wins, like llama.cpp
        pairs: list[tuple[str, str]] = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep or not left or not right:
                raise ValueError(f"malformed BPE merge {merge!r}")
            pairs.append((left, right))
        # Llama-3 style vocabularies look whole words up before merging (llama.cpp does too).
        ignore_merges = pre in ("llama-bpe", "llama3")
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
        except Exception as exc:  # tokenizers raises a bare Exception (e.g. merge not in vocab)
            raise ValueError(f"invalid BPE vocabulary: {exc}") from exc
        backend = BackendTokenizer(bpe)
        backend.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()

        types = list(token_types) if token_types is not None else [1] * len(tokens)
        special_ids = {i for i, t in enumerate(types) if t == _TOKEN_TYPE_CONTROL}
        special_ids.update(i for i in (bos_token_id, eos_token_id) if i is not None)
        special = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i in sorted(special_ids)
            if 0 <= i < len(tokens)
        ]
        user = [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _TOKEN_TYPE_USER_DEFINED and i not in special_ids
        ]
        # The strings are already in the BPE vocab, so these keep their GGUF ids.
        backend.add_special_tokens(special)
        backend.add_tokens(user)
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            add_bos_token=add_bos_token,
            chat_template=chat_template,
            extra_eos_token_ids=extra_eos_token_ids,
            vocab_size=len(tokens),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer directory.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (bos/eos tokens,
        ``add_bos_token``, ``chat_template``), ``chat_template.jinja`` (wins over the config's
        template, as in transformers) and ``generation_config.json`` (extra EOS ids), each if
        present.

        Raises:
            ModelNotFound: no ``tokenizer.json`` in ``path``.
            CorruptWeights: a file that does not parse; the message names it.
        """
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelNotFound(f"no tokenizer.json in {root}", path=str(tok_file))
        try:
            backend = BackendTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise CorruptWeights(f"cannot parse {tok_file}: {exc}", path=str(tok_file)) from exc
        # Some tokenizer.json files carry truncation/padding settings (e.g. max_length 512) that
        # would silently cut prompts; lengths are the engine's business.
        backend.no_truncation()
        backend.no_padding()
        config = read_json_object(root / "tokenizer_config.json", missing_ok=True)
        gen = read_json_object(root / "generation_config.json", missing_ok=True)

        bos_id = _special_id(backend, config.get("bos_token"))
        eos_id = _special_id(backend, config.get("eos_token"))
        gen_bos = int_list(gen.get("bos_token_id"))
        gen_eos = int_list(gen.get("eos_token_id"))
        if bos_id is None and gen_bos:
            bos_id = gen_bos[0]
        if eos_id is None and gen_eos:
            eos_id = gen_eos[0]

        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = _post_processor_adds_bos(backend, bos_id)

        template_file = root / "chat_template.jinja"
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _pick_template(config.get("chat_template"))
        )
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            add_bos_token=add_bos,
            chat_template=template,
            extra_eos_token_ids=gen_eos,
        )

    def save_hf(self, directory: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (created if
        needed) so that transformers' ``AutoTokenizer`` loads an equivalent tokenizer and
        :meth:`from_hf_dir` reads this one back. Extra EOS ids are not written (they belong in
        the model's generation_config.json)."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        backend = BackendTokenizer.from_str(self._backend.to_str())
        bos = self.bos_token
        if self.add_bos_token and bos is not None and self.bos_token_id is not None:
            # transformers adds special tokens through the post-processor; make it match ours.
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, self.bos_token_id)],
            )
        backend.save(str(root / "tokenizer.json"))
        added = {
            str(i): {
                "content": tok.content,
                "lstrip": tok.lstrip,
                "normalized": tok.normalized,
                "rstrip": tok.rstrip,
                "single_word": tok.single_word,
                "special": tok.special,
            }
            for i, tok in sorted(backend.get_added_tokens_decoder().items())
        }
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "bos_token": bos,
            "eos_token": self.eos_token,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(root / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")


# --------------------------------------------------------------------------------- helpers

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _ids(backend: BackendTokenizer, text: str) -> list[int]:
    """``backend``'s ids of ``text``, no special tokens added. ``encode_batch_fast``, not
    ``encode``: it lets go of the GIL while it works (``encode`` held it: two threads
    tokenizing 1.33 M characters each froze the event loop for their whole 12.6 s; through
    this the loop's longest pause was 116 ms, the list of ids being built) and skips the
    offsets nothing here reads (2.5x faster on that text). Ids are the same (tested)."""
    ids: list[int] = backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
    return ids


@functools.cache  # built once: token_bytes reads it per token (49k times for a vocabulary)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable character -> the byte it spells.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    mapped in order onto code points 256 and up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _normalize_messages(messages: object) -> list[dict[str, Any]]:
    """Validate messages and flatten list-of-parts content into one string per message."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string", param="messages")
        content = msg.get("content")
        if isinstance(content, list):
            content = "\n".join(_part_text(i, j, part) for j, part in enumerate(content))
        elif not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list of text parts",
                param="messages",
            )
        out.append({**msg, "content": content})
    return out


def _part_text(i: int, j: int, part: object) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text":
        raise InvalidRequest(
            f"messages[{i}].content[{j}] must be a {{'type': 'text', 'text': ...}} part "
            "(only text content is supported)",
            param="messages",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"messages[{i}].content[{j}].text must be a string", param="messages")
    return text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # As transformers: Jinja's own tojson HTML-escapes, which chat templates do not want.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _special_id(backend: BackendTokenizer, token: object) -> int | None:
    """Id of a tokenizer_config special token given as a string or an AddedToken dict."""
    if isinstance(token, Mapping):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    token_id: int | None = backend.token_to_id(token)
    return token_id


def _post_processor_adds_bos(backend: BackendTokenizer, bos_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (Llama-3 style configs say so there)."""
    if bos_id is None or backend.post_processor is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def _pick_template(value: object) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates ("default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None
