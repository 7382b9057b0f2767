"""The generated models' vocabulary: the small but real byte-level BPE our model generator writes into the qwen3moe
GGUFs it makes, with the same ``tokenizer.*`` keys llama.cpp's converter writes for Qwen3.

The BPE part was trained with the ``tokenizers`` library's BpeTrainer (byte-level alphabet, Qwen2 pre-tokenizer) on
``data/corpus.txt`` (original prose written for this project) and committed as ``data/bpe.json``, so every call in
every process gives the same vocabulary. ``train_bpe()`` regenerates it (``python -m
stratad.model.generated_vocab --regenerate``); a test checks the committed file still matches.
"""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from stratad.model.tokenizer import (DEFAULT_CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START, QWEN2_PRETOKENIZE_REGEX,
                                     THINK_END, THINK_START, Vocab, pre_tokenizer)

DATA_DIR = Path(__file__).with_name("data")
CORPUS_PATH = DATA_DIR / "corpus.txt"
BPE_PATH = DATA_DIR / "bpe.json"

# Placed right after the BPE tokens, in this order (the order Qwen3 has them in).
SPECIAL_TOKENS: tuple[tuple[str, gguf.TokenType], ...] = (
    (ENDOFTEXT, gguf.TokenType.CONTROL),
    (IM_START, gguf.TokenType.CONTROL),
    (IM_END, gguf.TokenType.CONTROL),
    (THINK_START, gguf.TokenType.USER_DEFINED),
    (THINK_END, gguf.TokenType.USER_DEFINED),
)
# The BPE part of a generated vocabulary holds at most this many tokens (256 byte tokens + merged tokens).
BPE_MAX_TOKENS = 2000
N_BYTE_TOKENS = 256


def _qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizer(QWEN2_PRETOKENIZE_REGEX)


def train_bpe(corpus: str, n_tokens: int) -> tuple[list[str], list[str]]:
    """Train a byte-level BPE of at most ``n_tokens`` tokens on ``corpus``; returns (tokens in id order, merges).

    The trainer stops early when the corpus has no pair left to merge. Used to (re)generate ``data/bpe.json``.
    """
    from tokenizers import trainers

    if n_tokens < N_BYTE_TOKENS:
        raise ValueError(f"a byte-level BPE needs at least {N_BYTE_TOKENS} tokens, got {n_tokens}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = _qwen2_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=n_tokens,
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _corpus_sha256() -> str:
    return hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()


def regenerate_bpe_data() -> dict[str, Any]:
    """Train on data/corpus.txt and rewrite data/bpe.json. Run after editing the corpus."""
    import tokenizers

    tokens, merges = train_bpe(CORPUS_PATH.read_text(encoding="utf-8"), BPE_MAX_TOKENS)
    data = {
        "comment": "byte-level BPE trained by stratad.model.generated_vocab.train_bpe on corpus.txt; do not edit by "
                   "hand",
        "tokenizers_version": tokenizers.__version__,
        "corpus_sha256": _corpus_sha256(),
        "tokens": tokens,
        "merges": merges,
    }
    BPE_PATH.write_text(json.dumps(data, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    _load_bpe.cache_clear()
    return data


@lru_cache(maxsize=1)
def _load_bpe() -> tuple[tuple[str, ...], tuple[str, ...]]:
    data = json.loads(BPE_PATH.read_text(encoding="utf-8"))
    return tuple(data["tokens"]), tuple(data["merges"])


def build_vocab(vocab_size: int) -> Vocab:
    """The generated models' vocabulary, exactly ``vocab_size`` tokens long; deterministic.

    Layout: BPE tokens (min(vocab_size - 5, 2000): 256 byte tokens, then merged tokens in merge order), then
    <|endoftext|>, <|im_start|>, <|im_end|> (CONTROL), <think>, </think> (USER_DEFINED), then [PAD{id}] (UNUSED)
    up to vocab_size, as llama.cpp's converter pads Qwen vocabularies.
    """
    vocab_size = int(vocab_size)
    n_special = len(SPECIAL_TOKENS)
    if vocab_size < N_BYTE_TOKENS + n_special:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: a byte-level vocabulary needs {N_BYTE_TOKENS} byte tokens "
            f"plus {n_special} special tokens"
        )
    all_tokens, all_merges = _load_bpe()
    n_bpe = min(vocab_size - n_special, len(all_tokens))
    tokens = list(all_tokens[:n_bpe])
    # A smaller training run stops after the merge that creates token n_bpe - 1: keep that prefix of the merges.
    index = {t: i for i, t in enumerate(all_tokens)}
    merges: list[str] = []
    for m in all_merges:
        a, b = m.split(" ")
        if index[a + b] >= n_bpe:
            break
        merges.append(m)
    token_types = [int(gguf.TokenType.NORMAL)] * n_bpe
    for text, ttype in SPECIAL_TOKENS:
        tokens.append(text)
        token_types.append(int(ttype))
    n_pad = vocab_size - len(tokens)
    tokens.extend(f"[PAD{i}]" for i in range(len(tokens), vocab_size))
    token_types.extend([int(gguf.TokenType.UNUSED)] * n_pad)
    return Vocab(
        tokens=tokens,
        token_types=token_types,
        merges=merges,
        eos_id=n_bpe + 2,  # <|im_end|>
        pad_id=n_bpe,  # <|endoftext|>
        bos_id=n_bpe,  # <|endoftext|>, with add_bos_token False
        chat_template=DEFAULT_CHAT_TEMPLATE,
        add_bos_token=False,
    )


def write_tokenizer(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    """Add the tokenizer keys a Qwen3 GGUF from llama.cpp's converter has."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_pad_token_id(vocab.pad_id)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_add_bos_token(vocab.add_bos_token)
    writer.add_chat_template(vocab.chat_template)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="stratad tokenizer data")
    p.add_argument("--regenerate", action="store_true", help="retrain data/bpe.json from data/corpus.txt")
    args = p.parse_args(argv)
    if args.regenerate:
        data = regenerate_bpe_data()
        print(f"wrote {BPE_PATH}: {len(data['tokens'])} tokens, {len(data['merges'])} merges")
    else:
        tokens, merges = _load_bpe()
        print(f"{BPE_PATH}: {len(tokens)} tokens, {len(merges)} merges")
    return 0


def warmup_text() -> str:
    """Prose to route through a model once at start (the built-in corpus), to seed the expert counts."""
    return CORPUS_PATH.read_text(encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(_main())
