"""A tiny Qwen3-MoE checkpoint whose routing is known in advance, shared by the activation and pruning tests.

Hidden channel 0 of every token is +C (token id < V/2, "plus" tokens) or -C (the others), and no layer changes it
(attention's o_proj and every expert's down_proj have row 0 zeroed); the routers read only that channel:
router logit of expert e = A[e] x rmsnorm(x)[0]. So in every layer a plus token picks the two experts with the
largest A and a minus token the two with the smallest:
    layer 0: A = [3, 2, 0, 0, 0, 0, -2, -3]  plus -> {0, 1}, minus -> {6, 7}; experts 2..5 never chosen
    layer 1: A = [0, 0, 3, 2, -2, -3, 0, 0]  plus -> {2, 3}, minus -> {4, 5}; experts 0, 1, 6, 7 never chosen
norm_topk_prob is true, so dropping never-chosen experts leaves every token's output unchanged.
"""
from __future__ import annotations

from pathlib import Path

import torch

V, H, E, I, K = 64, 32, 8, 16, 2
C = 4.0
A = [[3.0, 2.0, 0.0, 0.0, 0.0, 0.0, -2.0, -3.0], [0.0, 0.0, 3.0, 2.0, -2.0, -3.0, 0.0, 0.0]]
PLUS = {0: {0, 1}, 1: {2, 3}}
MINUS = {0: {6, 7}, 1: {4, 5}}


def plus(token: int) -> bool:
    return token < V // 2


def forced_checkpoint(path: Path, **config) -> Path:
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, intermediate_size=32,
                                      moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                      norm_topk_prob=True, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 1e4}, **config)
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)  # transformers' std 0.02 gives near-flat logits
    model.save_pretrained(path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    embed = tensors["model.embed_tokens.weight"]  # [V, H]
    embed[:, 0] = torch.where(torch.arange(V) < V // 2, C, -C)
    for layer in range(2):
        p = f"model.layers.{layer}."
        tensors[p + "self_attn.o_proj.weight"][0] = 0.0
        router = torch.zeros(E, H)
        router[:, 0] = torch.tensor(A[layer])
        tensors[p + "mlp.gate.weight"] = router
        for e in range(E):
            tensors[p + f"mlp.experts.{e}.down_proj.weight"][0] = 0.0
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path
