"""The model's tokenizer: a gpt2-style byte-level BPE vocabulary (the kind Qwen3 uses), stored in GGUF metadata.

The vocabulary our generator writes (``build_vocab``, ``write_tokenizer``) is made in ``generated_vocab.py``;
``Tokenizer.from_gguf(reader, path)`` here is the one code path that serves real Qwen3 GGUFs and generated ones:
encode / decode / streaming decode / chat template (``chat_template.py``).

Encoding is Hugging Face's Qwen2 tokenizer: text is NFC-normalised, split by the pre-tokenizer that
``tokenizer.ggml.pre`` names (only ``qwen2`` is implemented; any other name is refused when the file is loaded), and
BPE-merged; the added tokens (token types CONTROL and USER_DEFINED: ``<|im_start|>``, ``<think>``, ``<tool_call>``,
...) are cut out of the text first and become one id each. It gives llama.cpp's ids on llama.cpp's test vectors
for the real Qwen2 vocabulary (tests/test_tokenizer_real.py). Where a text is not NFC (e.g. an ``e`` followed by a
combining accent) llama.cpp's ids differ from Hugging Face's; we follow Hugging Face, which the model was trained
with, and decoding gives the NFC text.

``encode(text)`` takes added tokens wherever the text has them (a raw prompt). ``encode_chat(messages, ...)`` takes
them only where the chat template wrote them: what the caller sent (message content, tool arguments and results,
tools) is encoded as plain text even when it contains ``<|im_end|>``, so a user cannot write a system turn; for
content without added tokens the ids are those of ``encode(apply_chat_template(...))``.
"""

from __future__ import annotations

import codecs
import copy
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import gguf
import jinja2
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from stratad.model.chat_template import ChatTemplate, ChatTemplateError
from stratad.model.errors import ModelFormatError

__all__ = [
    "QWEN2_PRETOKENIZE_REGEX",
    "PRE_TOKENIZERS",
    "DEFAULT_CHAT_TEMPLATE",
    "ENDOFTEXT",
    "IM_START",
    "IM_END",
    "THINK_START",
    "THINK_END",
    "ChatTemplateError",
    "Vocab",
    "Tokenizer",
    "StreamDecoder",
]


# The pre-tokenizer regex of Qwen2/Qwen3 (llama.cpp: LLAMA_VOCAB_PRE_TYPE_QWEN2).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the split regex. llama.cpp knows more names; a file naming one of them is refused rather
# than split with the wrong regex. Each is Hugging Face's tokenizer for that model: NFC, then this split.
PRE_TOKENIZERS = {"qwen2": QWEN2_PRETOKENIZE_REGEX}

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"

# Our own ChatML template, Qwen3 style: every message is <|im_start|>{role}\n{content}<|im_end|>\n, and the
# generation prompt is <|im_start|>assistant\n.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] is not string or message['content'] is not string -%}\n"
    "{{- raise_exception('each message needs a string role and a string content') -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)

# GGUF keys (the same ones llama.cpp's converter writes for a Qwen3 model).
K = gguf.Keys.Tokenizer
KEY_MODEL = K.MODEL  # tokenizer.ggml.model
KEY_PRE = K.PRE  # tokenizer.ggml.pre
KEY_TOKENS = K.LIST  # tokenizer.ggml.tokens
KEY_TOKEN_TYPE = K.TOKEN_TYPE  # tokenizer.ggml.token_type
KEY_MERGES = K.MERGES  # tokenizer.ggml.merges
KEY_EOS = K.EOS_ID  # tokenizer.ggml.eos_token_id
KEY_PAD = K.PAD_ID  # tokenizer.ggml.padding_token_id
KEY_BOS = K.BOS_ID  # tokenizer.ggml.bos_token_id
KEY_EOT = K.EOT_ID  # tokenizer.ggml.eot_token_id (optional, honoured as a stop token)
KEY_ADD_BOS = K.ADD_BOS  # tokenizer.ggml.add_bos_token
KEY_CHAT_TEMPLATE = K.CHAT_TEMPLATE  # tokenizer.chat_template


# --------------------------------------------------------------------------------------------------------------
# Byte-level alphabet (GPT-2's bytes_to_unicode)


def _bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


BYTE_TO_CHAR: dict[int, str] = _bytes_to_unicode()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}


def pre_tokenizer(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )




@dataclass(frozen=True)
class Vocab:
    """A tokenizer vocabulary as GGUF stores it."""

    tokens: list[str]
    token_types: list[int]  # gguf.TokenType values, one per token
    merges: list[str]  # "a b", in merge-priority order
    eos_id: int
    pad_id: int
    bos_id: int
    chat_template: str = DEFAULT_CHAT_TEMPLATE
    add_bos_token: bool = False

    def __len__(self) -> int:
        return len(self.tokens)



# --------------------------------------------------------------------------------------------------------------
# The runtime tokenizer


_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, path, kind: str, required: bool = True) -> Any:
    """Read one metadata value, checking its GGUF type. kind: 'str', 'int', 'bool', 'str[]', 'int[]'."""
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ModelFormatError(path, f"tokenizer metadata {key} is missing")
        return _MISSING
    VT = gguf.GGUFValueType
    ints = {VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64}
    types = list(f.types)
    ok = bool(types) and {
        "str": lambda: types == [VT.STRING],
        "int": lambda: len(types) == 1 and types[0] in ints,
        "bool": lambda: types == [VT.BOOL],
        "str[]": lambda: types[0] == VT.ARRAY and (len(f.data) == 0 or types[-1] == VT.STRING),
        "int[]": lambda: types[0] == VT.ARRAY and (len(f.data) == 0 or types[-1] in ints),
    }[kind]()
    if not ok:
        names = "/".join(t.name for t in types) or "nothing"
        raise ModelFormatError(path, f"tokenizer metadata {key} has type {names}, expected {kind}")
    if kind.endswith("[]") and len(f.data) == 0:
        return []
    try:
        return f.contents()
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFormatError(path, f"tokenizer metadata {key} cannot be read: {e}") from e


class StreamDecoder:
    """Turns token ids into text as they are generated; never emits half a UTF-8 character.

    ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: "Tokenizer", skip_special: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one token; returns the text it completed (possibly empty)."""
        return self._dec.decode(self._tok._bytes_for_decode(token_id, self._skip_special))

    def flush(self) -> str:
        """End of stream: returns what is left (an unfinished character becomes U+FFFD) and resets."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


class Tokenizer:
    """A gpt2-style byte-level BPE tokenizer (NFC, then the pre-tokenizer ``pre`` names), built from GGUF metadata."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        merges: Sequence[str],
        eos_id: int,
        *,
        bos_id: int | None = None,
        pad_id: int | None = None,
        eot_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        model: str = "gpt2",
        pre: str = "qwen2",
        path: str | Path = "<tokenizer>",
    ):
        self.path = str(path)
        if model != "gpt2":
            raise ModelFormatError(path, f"tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported")
        if pre not in PRE_TOKENIZERS:
            raise ModelFormatError(
                path,
                f"tokenizer.ggml.pre is {pre!r}: that pre-tokenizer is not implemented here "
                f"(implemented: {', '.join(PRE_TOKENIZERS)})",
            )
        tokens = list(tokens)
        if not tokens:
            raise ModelFormatError(path, "tokenizer.ggml.tokens is empty: the file has no vocabulary")
        n = len(tokens)
        if token_types is None:
            token_types = [int(gguf.TokenType.NORMAL)] * n
        token_types = [int(t) for t in token_types]
        if len(token_types) != n:
            raise ModelFormatError(
                path, f"tokenizer.ggml.token_type has {len(token_types)} entries but there are {n} tokens"
            )
        valid_types = {int(t) for t in gguf.TokenType}
        bad = next((i for i, t in enumerate(token_types) if t not in valid_types), None)
        if bad is not None:
            raise ModelFormatError(path, f"token {bad} has unknown token type {token_types[bad]}")

        for key, value in ((KEY_EOS, eos_id), (KEY_BOS, bos_id), (KEY_PAD, pad_id), (KEY_EOT, eot_id)):
            if value is not None and not (0 <= int(value) < n):
                raise ModelFormatError(path, f"{key} is {value}, out of range for a vocabulary of {n} tokens")

        # First occurrence wins if a token text repeats (the id -> text table keeps every entry).
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        if any(c not in vocab for c in BYTE_TO_CHAR.values()):
            missing = sum(c not in vocab for c in BYTE_TO_CHAR.values())
            raise ModelFormatError(path, f"the vocabulary lacks {missing} of the 256 byte-level base tokens")

        merge_pairs: list[tuple[str, str]] = []
        for k, m in enumerate(merges):
            parts = m.split(" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise ModelFormatError(path, f"tokenizer.ggml.merges[{k}] = {m!r} is not of the form 'a b'")
            a, b = parts
            for piece in (a, b, a + b):
                if piece not in vocab:
                    raise ModelFormatError(
                        path, f"tokenizer.ggml.merges[{k}] = {m!r} refers to unknown token {piece!r}"
                    )
            merge_pairs.append((a, b))

        self._tokens = tokens
        self._types = token_types
        self._vocab = vocab
        self._merge_pairs = merge_pairs
        self.pre = pre
        self._eos_id = int(eos_id)
        self._bos_id = None if bos_id is None else int(bos_id)
        self._pad_id = None if pad_id is None else int(pad_id)
        self.add_bos_token = bool(add_bos_token)
        self._bytes_cache: dict[int, bytes] = {}

        CONTROL, USER = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
        self._control_ids = frozenset(i for i, t in enumerate(token_types) if t == CONTROL)
        self._added_ids = frozenset(i for i, t in enumerate(token_types) if t in (CONTROL, USER))

        stop = {self._eos_id}
        if ENDOFTEXT in vocab:
            stop.add(vocab[ENDOFTEXT])
        if eot_id is not None:
            stop.add(int(eot_id))
        self._stop_ids = frozenset(stop)

        # Added tokens are cut out of the text before the BPE sees it, longest first where two start at one place
        # (Hugging Face's leftmost-longest match). Empty texts cannot be matched.
        added = sorted({tokens[i] for i in self._added_ids if tokens[i]}, key=len, reverse=True)
        self._added_re = re.compile("|".join(map(re.escape, added))) if added else None
        reply = sorted({tokens[i] for i in self._added_ids - self._control_ids if tokens[i]}, key=len, reverse=True)
        self._reply_re = re.compile("|".join(map(re.escape, reply))) if reply else None

        # The BPE alone, no added tokens: every piece of text between added tokens goes through it.
        self._bpe = self._hf_tokenizer(added_tokens=False)

        self.chat_template = DEFAULT_CHAT_TEMPLATE if chat_template is None else chat_template
        self._chat = self._compile_template(self.chat_template, path)

    def _hf_tokenizer(self, added_tokens: bool) -> HFTokenizer:
        hf = HFTokenizer(models.BPE(vocab=self._vocab, merges=self._merge_pairs, fuse_unk=False, byte_fallback=False))
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizer(PRE_TOKENIZERS[self.pre])
        hf.decoder = decoders.ByteLevel()
        if added_tokens:
            toks = self._tokens
            special = [AddedToken(toks[i], special=True, normalized=False) for i in sorted(self._control_ids)]
            user = [
                AddedToken(toks[i], special=False, normalized=False)
                for i in sorted(self._added_ids - self._control_ids)
            ]
            if special:
                hf.add_special_tokens(special)
            if user:
                hf.add_tokens(user)
            for i in sorted(self._added_ids):
                if self._vocab[toks[i]] == i and hf.token_to_id(toks[i]) != i:
                    raise ModelFormatError(self.path, f"special token {toks[i]!r} (id {i}) could not be registered")
        return hf

    def _compile_template(self, source: str, path) -> ChatTemplate:
        special = {"eos_token": self._tokens[self._eos_id]}
        if self._bos_id is not None:
            special["bos_token"] = self._tokens[self._bos_id]
        try:
            return ChatTemplate(source, special)
        except jinja2.TemplateError as e:
            raise ModelFormatError(path, f"tokenizer.chat_template does not compile: {e}") from e

    @cached_property
    def hf(self) -> HFTokenizer:
        """The same tokenizer as a Hugging Face ``tokenizers`` object with the added tokens registered (CONTROL as
        special), e.g. for transformers' ``PreTrainedTokenizerFast(tokenizer_object=...)``. Built on first use."""
        return self._hf_tokenizer(added_tokens=True)

    def with_chat_template(self, source: str) -> "Tokenizer":
        """The same vocabulary with another chat template (e.g. an operator's template file instead of the GGUF's)."""
        other = copy.copy(self)
        other.chat_template = source
        other._chat = self._compile_template(source, "<chat template>")
        return other

    # ---- construction ----

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, path: str | Path | None = None) -> "Tokenizer":
        """Build from a GGUF's tokenizer metadata; raises ModelFormatError naming the problem."""
        path = path if path is not None else getattr(reader, "path", "<gguf>")
        model = _field(reader, KEY_MODEL, path, "str")
        if model != "gpt2":
            raise ModelFormatError(path, f"tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported")
        pre = _field(reader, KEY_PRE, path, "str", required=False)
        if pre is _MISSING:
            raise ModelFormatError(
                path, f"tokenizer.ggml.pre is missing: the file does not name its pre-tokenizer "
                f"(implemented: {', '.join(PRE_TOKENIZERS)})"
            )
        tokens = _field(reader, KEY_TOKENS, path, "str[]")
        if not tokens:
            raise ModelFormatError(path, "tokenizer.ggml.tokens is empty: the file has no vocabulary")
        types = _field(reader, KEY_TOKEN_TYPE, path, "int[]", required=False)
        merges = _field(reader, KEY_MERGES, path, "str[]")
        eos = _field(reader, KEY_EOS, path, "int")

        def opt(key: str, kind: str) -> Any:
            v = _field(reader, key, path, kind, required=False)
            return None if v is _MISSING else v

        return cls(
            tokens,
            None if types is _MISSING else types,
            merges,
            eos,
            bos_id=opt(KEY_BOS, "int"),
            pad_id=opt(KEY_PAD, "int"),
            eot_id=opt(KEY_EOT, "int"),
            add_bos_token=bool(opt(KEY_ADD_BOS, "bool") or False),
            chat_template=opt(KEY_CHAT_TEMPLATE, "str"),
            model=model,
            pre=pre,
            path=path,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        try:
            reader = gguf.GGUFReader(path, "r")
        except (ValueError, OSError) as e:
            raise ModelFormatError(path, f"cannot read as GGUF: {e}") from e
        return cls.from_gguf(reader, path)

    @classmethod
    def from_vocab(cls, vocab: Vocab, path: str | Path = "<generated vocab>") -> "Tokenizer":
        return cls(
            vocab.tokens,
            vocab.token_types,
            vocab.merges,
            vocab.eos_id,
            bos_id=vocab.bos_id,
            pad_id=vocab.pad_id,
            add_bos_token=vocab.add_bos_token,
            chat_template=vocab.chat_template,
            path=path,
        )

    # ---- properties ----

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def stop_ids(self) -> frozenset[int]:
        """Generation stops at any of these: eos, <|endoftext|>, and eot when the file names one."""
        return self._stop_ids

    def token_text(self, token_id: int) -> str:
        """The token's text as the vocabulary stores it (byte-level form, e.g. 'Ġthe'; specials as written)."""
        return self._tokens[self._check_id(token_id)]

    def token_type(self, token_id: int) -> int:
        return self._types[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id of a token given its vocabulary text, or None."""
        return self._vocab.get(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for when decoded."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            i = self._check_id(token_id)
            text = self._tokens[i]
            if i in self._added_ids:
                b = text.encode("utf-8")
            else:
                try:
                    b = bytes(CHAR_TO_BYTE[c] for c in text)
                except KeyError:  # not byte-level text: emit as is (as the tokenizers ByteLevel decoder does)
                    b = text.encode("utf-8")
            self._bytes_cache[i] = b
        return b

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < len(self._tokens):
            raise ValueError(f"token id {token_id} is out of range for a vocabulary of {len(self._tokens)} tokens")
        return i

    def _bytes_for_decode(self, token_id: int, skip_special: bool) -> bytes:
        if skip_special and int(token_id) in self._control_ids:
            return b""
        return self.token_bytes(token_id)

    # ---- encode / decode ----

    def _encode(self, text: str, cuts: list[re.Match]) -> list[int]:
        """Ids of text where the matches ``cuts`` (ordered, not overlapping) are added tokens and every piece
        between them is plain text."""
        pieces, specials, at = [], [], 0
        for m in cuts:
            pieces.append(text[at : m.start()])
            specials.append(self._vocab[m.group()])
            at = m.end()
        pieces.append(text[at:])
        ids = [self._bos_id] if self.add_bos_token and self._bos_id is not None else []
        # One piece at a time: the batch calls use the tokenizers thread pool, which a later fork (a lane started)
        # would have to disable with a warning in the child.
        for k, piece in enumerate(pieces):
            if piece:
                ids.extend(self._bpe.encode(piece, add_special_tokens=False).ids)
            if k < len(specials):
                ids.append(specials[k])
        return ids

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids for text. special: added tokens written in the text (e.g. <|im_start|>) become their single
        id; False: the whole text is plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        cuts = list(self._added_re.finditer(text)) if special and self._added_re is not None else []
        return self._encode(text, cuts)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for token ids; invalid UTF-8 (e.g. a character cut off at the end) becomes U+FFFD."""
        return b"".join(self._bytes_for_decode(i, skip_special) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    # ---- chat ----

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **kwargs: Any,
    ) -> str:
        """The chat as the GGUF's template renders it (sandboxed Jinja; what transformers' apply_chat_template gives).
        Extra keyword arguments are passed to the template. Raises ChatTemplateError (a ValueError).

        Text only: encode it with ``encode_chat`` instead, which keeps the caller's text from writing special tokens.
        """
        return self._chat.render(messages, tools, add_generation_prompt, enable_thinking, **kwargs).plain()

    def encode_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        *,
        prefill: str = "",
        **kwargs: Any,
    ) -> list[int]:
        """The chat's token ids: added tokens only where the template wrote them; the messages, tools and keyword
        arguments are plain text, whatever they contain. ``prefill`` (the start of the reply, after the generation
        prompt) may write the tokens a reply holds (USER_DEFINED: ``<think>``, ``<tool_call>``, ...) but not the
        CONTROL ones that end a turn (``<|im_end|>``, ``<|im_start|>``, ``<|endoftext|>``).
        Raises ChatTemplateError (a ValueError)."""
        if not isinstance(prefill, str):
            raise ChatTemplateError(f"prefill must be a string, got {type(prefill).__name__}")
        chat = self._chat.render(messages, tools, add_generation_prompt, enable_thinking, **kwargs)
        text = chat.plain() + prefill
        cuts = []
        if self._added_re is not None:
            for s, e in chat.literal_spans:
                cuts.extend(self._added_re.finditer(text, s, e))
        if prefill and self._reply_re is not None:
            cuts.extend(self._reply_re.finditer(text, len(chat)))
        return self._encode(text, cuts)
