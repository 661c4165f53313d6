"""Shared by the model tests."""
import torch


def spread_weights_(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' init (std 0.02, zero biases) gives near-flat logits and routing, which makes tests weak and
    routing near-ties likely: scale the matrices up and give the biases values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(5.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs|: the logits tolerance of the model tests."""
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def min_router_margin(model, ids, top_k=2) -> float:
    """Smallest gap, over MoE layers and tokens, between the k-th and (k+1)-th routing probabilities of a transformers
    model (a near tie lets bf16 rounding pick a different expert, and one rerouted token moves the logits by ~10%)."""
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits  # per MoE layer [T, E]
    probs = [r.float().softmax(-1).sort(-1, descending=True).values for r in router_logits]
    return min((p[:, top_k - 1] - p[:, top_k]).min().item() for p in probs)


def prefill_error(path, theirs, prompt: torch.Tensor) -> float:
    """rel_err of cpumoe's float32 prefill logits (the checkpoint at path) against transformers' model's on prompt
    [1, T]; the shapes and dtype checked on the way."""
    from cpumoe.models import load_model
    with torch.no_grad():
        expected = theirs(prompt).logits.float()  # [1, T, V]
    out = load_model(path)(prompt)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    return rel_err(out, expected)


def generate_reference(theirs, prompt: torch.Tensor, tokens: int = 10) -> list[int]:
    """transformers' greedy continuation of prompt [1, T] (its own KV cache)."""
    with torch.no_grad():
        return theirs.generate(prompt, do_sample=False, max_new_tokens=tokens)[0, prompt.shape[1]:].tolist()


def greedy_without_cache(ours, theirs, prompt: torch.Tensor, steps: int = 8) -> tuple[list, list]:
    """`steps` greedy tokens from our model and transformers' one, each re-running the whole sequence per step
    (no KV cache). prompt [1, T] -> both token lists, prompt included."""
    ids_ours, ids_theirs = prompt, prompt
    for _ in range(steps):
        ids_ours = torch.cat([ids_ours, ours(ids_ours)[:, -1].argmax(-1, keepdim=True)], dim=1)
        with torch.no_grad():
            nxt = theirs(ids_theirs).logits[:, -1].argmax(-1, keepdim=True)
        ids_theirs = torch.cat([ids_theirs, nxt], dim=1)
    return ids_ours.tolist(), ids_theirs.tolist()


def engine_greedy(path, prompts: list[list[int]], *, budget: int, max_tokens: int = 10,
                  num_blocks: int = 64) -> list[list[int]]:
    """Greedy completions of prompts, all at once, from cpumoe's engine (4-token cache blocks, `budget` tokens a
    step: a small budget chunks the prefills)."""
    from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(path, config=EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget))
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [out.new_token_ids for out in outs]


def routers(model, ids):
    """Per MoE layer: transformers' router logits [T, E] and the layer's correction bias [E]."""
    with torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
    first = model.config.first_k_dense_replace
    return [(rl.float(), layer.mlp.gate.e_score_correction_bias.float())
            for rl, layer in zip(logits, model.model.layers[first:])]


def choose(logits, bias, config, grouped=True):
    """The sigmoid router with a correction bias and grouped top-k (DeepSeek-V3, GLM-4.5), written out: ids [T, k] (sorted), and the smallest margin of its decisions (the
    topk_group-th vs the next group score, the k-th vs the next selectable choice score)."""
    choice = logits.sigmoid() + bias  # [T, E]
    T, E = choice.shape
    k, margins = config.num_experts_per_tok, []
    if grouped and config.n_group > 1:
        groups = choice.view(T, config.n_group, -1)  # [T, G, E/G]
        group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [T, G]
        ordered = group_scores.sort(-1, descending=True).values
        if config.topk_group < config.n_group:
            margins.append(ordered[:, config.topk_group - 1] - ordered[:, config.topk_group])
        kept = group_scores.topk(config.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros(T, config.n_group, dtype=torch.bool).scatter_(1, kept, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    top = choice.topk(k + 1, dim=-1).values  # [T, k + 1]
    margins.append(top[:, k - 1] - top[:, k])
    return choice.topk(k, dim=-1).indices.sort(-1).values, min(m.min().item() for m in margins)
