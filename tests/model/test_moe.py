"""SparseMoE against the definition, token by token: softmax router, top-k, optional renormalization,
optional shared expert behind a sigmoid gate; a lone token (its own path) and a batch (grouped per expert)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.model.config import ModelConfig, MoEConfig
from nanoserve.model.layers.moe import SparseMoE


def _moe(normalize: bool, shared: int) -> SparseMoE:
    config = ModelConfig(
        architecture="MixtralForCausalLM", name="moe", vocab_size=1, hidden_size=32, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=32, intermediate_size=32, rms_norm_eps=1e-5, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=1, tie_word_embeddings=True,
        moe=MoEConfig(6, 2, 16, norm_topk_prob=normalize, shared_expert_intermediate_size=shared),
    )  # fmt: skip
    torch.manual_seed(0)
    moe = SparseMoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def _reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    rows = []
    for token in x:
        probs = torch.softmax(moe.gate(token), dim=-1)
        weights, experts = probs.topk(moe.top_k)
        if moe.normalize:
            weights = weights / weights.sum()
        row = sum(w * moe.experts[int(e)](token[None])[0] for w, e in zip(weights, experts, strict=True))
        if moe.shared_expert is not None and moe.shared_expert_gate is not None:
            row = row + torch.sigmoid(moe.shared_expert_gate(token)) * moe.shared_expert(token[None])[0]
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("normalize, shared", [(True, 0), (False, 24)], ids=["mixtral", "qwen2-moe"])
def test_sparse_moe_matches_the_definition(tokens, normalize, shared):
    moe = _moe(normalize, shared)
    x = torch.randn(tokens, 32)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)
