"""The architecture corpus (tests/corpus_models.py) under float16 and bfloat16 vs float32.

Each case is a real model family's code path, written without jaxamp in mind; each test reads
the numbers ``tests/corpus.py`` measures (the same ones CORPUS.md tabulates) and fails with
every threshold the row misses: loss within 1e-2 (f16) / 3e-2 (bf16) of float32, gradient
cosine >= 0.999 (bf16: or at least Flax's own ``dtype=`` model's), every matmul in the compute
dtype, exp/log/rsqrt/logistic and every sum of the forward in float32, no forward lossy round
trip, and 20 ``make_train_step`` steps that reduce the loss with no skip after the fifth.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from corpus import POLICIES, measure, problems  # noqa: E402
from corpus_models import CORPUS  # noqa: E402


@pytest.mark.parametrize("dtype", list(POLICIES))
@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus(name, dtype):
    row = measure(name, dtype)
    assert row["matmuls"] > 0 and row["sensitive"] > 0  # the program was read at all
    assert problems(row) == []
