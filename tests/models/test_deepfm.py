"""DeepFM: plain nn.Embedding per field, the FM's pairwise term, bags of ids, sparse gradients."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from towerflow.models.deepfm import DeepFM, deepfm_loss


def test_every_field_has_its_own_plain_embeddings() -> None:
    model = DeepFM([10, 20, 30], dim=4, hidden=(8,))
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    assert [(t.num_embeddings, t.embedding_dim) for t in tables] == [
        (10, 4), (20, 4), (30, 4), (10, 1), (20, 1), (30, 1)]
    assert all(t.sparse for t in tables)


def test_the_second_order_term_is_the_sum_over_field_pairs() -> None:
    torch.manual_seed(0)
    model = DeepFM([5, 6, 7], dim=3, hidden=())
    nn.init.zeros_(model.mlp[-1].weight)
    nn.init.zeros_(model.mlp[-1].bias)
    for table in model.weights:
        nn.init.zeros_(table.weight)
    fields = [torch.tensor([1, 4]), torch.tensor([2, 0]), torch.tensor([6, 3])]
    vectors = [t.weight[ids] for t, ids in zip(model.embeddings, fields, strict=True)]
    pairs = sum((vectors[i] * vectors[j]).sum(1) for i, j in itertools.combinations(range(3), 2))
    assert torch.allclose(model(fields), pairs, atol=1e-6)


def test_a_bag_field_sums_its_ids_and_zero_pads() -> None:
    model = DeepFM([4, 9], dim=2, hidden=(4,))
    user = torch.tensor([1, 1])
    padded = model([user, torch.tensor([[3, 5, 0], [3, 5, 0]])])
    same = model([user, torch.tensor([[3, 5], [5, 3]])])
    assert torch.allclose(padded, same, atol=1e-6)


def test_gradients_are_row_sparse_and_the_loss_is_bce() -> None:
    model = DeepFM([10, 3], dim=4, dense_features=2, hidden=(8,))
    batch = ([torch.tensor([1, 2, 2]), torch.tensor([0, 1, 2])], torch.randn(3, 2),
             torch.tensor([1.0, 0.0, 1.0]))
    loss = deepfm_loss(model, batch)
    expected = nn.functional.binary_cross_entropy_with_logits(model(batch[0], batch[1]),
                                                              batch[2])
    assert torch.allclose(loss, expected)
    loss.backward()
    grad = model.embeddings[0].weight.grad
    assert grad.is_sparse and set(grad.coalesce().indices()[0].tolist()) == {1, 2}
    torch.optim.Adagrad(model.parameters(), lr=0.1).step()
