"""A mixture of experts whose experts are separate modules (tests/test_moe.py; loaded as remote code, auto_map):
transformers 5's Qwen3-MoE with each block's experts an nn.ModuleList of MLPs that runs only the experts its tokens
reach, as transformers 4's Qwen3-MoE and Mixtral did and remote-code DeepSeek still does. Under ZeRO-3 such a block
gathers only those experts' weights unless the block is a ZeRO-3 leaf (harness/moe/zero3.py); its class is not in
DeepSpeed's default leaf list."""

import torch
from torch import nn
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeMLP, Qwen3MoeTopKRouter


class SepMoeConfig(Qwen3MoeConfig):
    model_type = "sepmoe"


class SepMoeExperts(nn.ModuleList):
    """One Qwen3MoeMLP per expert; only the experts some token reaches run."""

    def __init__(self, config):
        super().__init__([Qwen3MoeMLP(config, intermediate_size=config.moe_intermediate_size)
                          for _ in range(config.num_experts)])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            out.index_add_(0, token, (self[e](hidden_states[token]) * top_k_weights[token, slot, None]).to(out.dtype))
        return out


class SepMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = Qwen3MoeTopKRouter(config)
        self.experts = SepMoeExperts(config)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        flat = hidden_states.reshape(-1, h)
        _, weights, chosen = self.gate(flat)
        return self.experts(flat, chosen, weights).reshape(b, s, h)


class SepMoeForCausalLM(Qwen3MoeForCausalLM):
    config_class = SepMoeConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = SepMoeBlock(config)
        self.post_init()
