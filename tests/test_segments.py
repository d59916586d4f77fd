"""Packed documents do not see each other: editing one document leaves every other document's logits unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxshard.model.transformer import Transformer
from tests.helpers import tiny_config


def _packed_row(first_doc: list[int], second_doc: list[int], length: int) -> tuple[jax.Array, ...]:
    """One row [1, length]: doc 1, doc 2, then padding (segment 0); positions restart at each document."""
    pad = length - len(first_doc) - len(second_doc)
    tokens = first_doc + second_doc + [0] * pad
    segments = [1] * len(first_doc) + [2] * len(second_doc) + [0] * pad
    positions = list(range(len(first_doc))) + list(range(len(second_doc))) + [0] * pad
    return tuple(jnp.asarray([row], jnp.int32) for row in (tokens, segments, positions))


def test_editing_one_document_leaves_the_other_alone():
    cfg = tiny_config()
    model = Transformer(cfg.model)
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(3, 259, 12).tolist(), rng.integers(3, 259, 14).tolist()
    edited_a = [t + 1 for t in doc_a]
    original = _packed_row(doc_a, doc_b, cfg.max_target_length)
    edited = _packed_row(edited_a, doc_b, cfg.max_target_length)
    params = model.init(jax.random.key(0), *original)["params"]
    logits = model.apply({"params": params}, *original)
    logits_edited = model.apply({"params": params}, *edited)
    b = slice(len(doc_a), len(doc_a) + len(doc_b))
    np.testing.assert_allclose(logits_edited[0, b], logits[0, b], rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(logits_edited[0, : len(doc_a)] - logits[0, : len(doc_a)])).max() > 1e-3


def test_document_logits_do_not_depend_on_where_it_is_packed():
    """Positions restart per document, so a document's logits are the same at the start or the middle of a row."""
    cfg = tiny_config()
    model = Transformer(cfg.model)
    rng = np.random.default_rng(1)
    doc_a, doc_b = rng.integers(3, 259, 10).tolist(), rng.integers(3, 259, 8).tolist()
    params = model.init(jax.random.key(0), *_packed_row(doc_a, doc_b, cfg.max_target_length))["params"]
    second = model.apply({"params": params}, *_packed_row(doc_a, doc_b, cfg.max_target_length))
    first = model.apply({"params": params}, *_packed_row(doc_b, doc_a, cfg.max_target_length))
    np.testing.assert_allclose(second[0, len(doc_a) : len(doc_a) + len(doc_b)], first[0, : len(doc_b)], atol=1e-5)
