"""SparseMoE: each token goes to the top-k of N gated-MLP experts (Mixtral, Qwen2-MoE, Qwen3-MoE).

The router's softmax picks k experts per token; their weights are renormalized to sum to one where the
family does so (Mixtral; Qwen with norm_topk_prob). Tokens are then grouped per expert with one sort and
one bincount, so each expert runs one matmul over all its tokens of the step: the Python loop is over
experts that got tokens, never over tokens. A lone token (decode at batch 1) skips the grouping, whose
dozen small ops cost as much as its two experts' matmuls. Qwen2-MoE adds a shared expert that every token passes
through, scaled by a sigmoid gate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.model.config import ModelConfig
from nanoserve.model.layers.mlp import GatedMLP


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k, self.normalize = moe.num_experts_per_tok, moe.norm_topk_prob
        # plain nn.Linear: the router is not quantized (nor pre-packed: too narrow to gain from it)
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
        weights, experts = self.route(x)  # [T, k] each
        if x.shape[0] == 1:  # decode at batch 1: its k experts, nothing to group
            chosen = zip(experts[0].tolist(), weights[0].tolist(), strict=True)
            expert, weight = next(chosen)
            out = self.experts[expert](x) * weight
            for expert, weight in chosen:
                out.add_(self.experts[expert](x), alpha=weight)
        else:
            out = self.grouped(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """float32 weights and expert ids [T, k] of each token's top k."""
        # float32: the choice of experts is the step most sensitive to rounding, and on CPU a float32
        # matmul this narrow runs faster than a bf16 one from 8 tokens up
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, num_experts]
        if self.normalize:  # the top-k probabilities renormalized are the softmax of the top-k logits
            top, experts = logits.topk(self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), experts
        return torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)

    def grouped(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        # (token, choice) slots sorted by expert: each expert's tokens are one contiguous run
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
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
        return torch.zeros_like(x).index_add_(0, tokens, outputs)
