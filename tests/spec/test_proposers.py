"""Prompt lookup (n-gram) proposals."""

from __future__ import annotations

import numpy as np

from k3serve.engine.spec.proposer import ngram_lookup


def test_ngram_lookup():
    a = np.array
    assert ngram_lookup(a([5, 6, 7, 8, 5, 6]), 1, 3, 4) == [7, 8, 5, 6]  # longest n first
    assert ngram_lookup(a([5, 6, 7, 8, 5, 6]), 1, 3, 1) == [7]
    assert ngram_lookup(a([5, 6, 7, 8]), 1, 3, 4) == []  # nothing recurs
    assert ngram_lookup(a([1, 9, 2, 1, 8, 2, 1]), 1, 1, 2) == [8, 2]  # the latest match
    assert ngram_lookup(a([1, 9, 2, 1, 8, 2, 1]), 2, 2, 2) == [8, 2]
    # a repeating span goes on past the sequence's end with the proposals themselves
    assert ngram_lookup(a([1, 2, 3, 1, 2, 3, 1, 2]), 1, 3, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert ngram_lookup(a([4, 4]), 1, 1, 3) == [4, 4, 4]
