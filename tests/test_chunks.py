"""How a card cuts a prompt into chunks (stratad.engine.chunks): sizes, the rows of logits each returns, the last flag."""
from __future__ import annotations

import pytest

from stratad.engine.chunks import PROMPT_CHUNK, chunks


@pytest.mark.parametrize("logits,rows", [("all", [4, 4, 2]), ("last", [0, 0, 1]), ("none", [0, 0, 0])])
def test_chunks_of_a_given_size(logits, rows):
    got = list(chunks(list(range(10)), logits, 4))
    assert [list(c) for c, _, _ in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [r for _, r, _ in got] == rows
    assert [last for _, _, last in got] == [False, False, True]


def test_default_size_and_an_exact_multiple():
    got = list(chunks(list(range(2 * PROMPT_CHUNK)), "last"))
    assert [len(c) for c, _, _ in got] == [PROMPT_CHUNK, PROMPT_CHUNK]
    assert [(r, last) for _, r, last in got] == [(0, False), (1, True)]
