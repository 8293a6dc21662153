"""SparseMoE: each token goes to the top-k of N gated-MLP experts (Mixtral, Qwen2-MoE, Qwen3-MoE).

The router's softmax picks k experts per token; their weights are renormalized to sum to one where the
family does so (Mixtral; Qwen with norm_topk_prob). Tokens are then grouped per expert with one sort and
one bincount, so each expert runs one matmul over all its tokens of the step: the Python loop is over
experts that got tokens, never over tokens. Qwen2-MoE adds a shared expert that every token passes
through, scaled by a sigmoid gate.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nanoserve.model.config import ModelConfig
from nanoserve.model.layers.mlp import GatedMLP


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k, self.normalize = moe.num_experts_per_tok, moe.norm_topk_prob
        # plain nn.Linear: routers are not pre-packed or quantized, their choice of expert stays exact
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, moe.intermediate_size, config.hidden_act)
            for _ in range(moe.num_experts)
        )
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(
                config.hidden_size, moe.shared_expert_intermediate_size, config.hidden_act
            )
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, num_experts]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # (token, choice) slots sorted by expert: each expert's tokens are one contiguous run
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        inputs = x.index_select(0, tokens)  # [T * k, hidden]
        outputs = torch.cat(
            [
                expert(rows)
                for expert, rows in zip(self.experts, inputs.split(counts), strict=True)
                if rows.shape[0]
            ]
        )
        outputs = outputs * weights.flatten()[order].unsqueeze(1).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, tokens, outputs)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
