"""Every registered architecture against transformers, from one table: the registry (cpumoe.models.ARCHITECTURES).

For each architecture, its `tiny` config (every feature of the architecture switched on, a few hundred kB) on top
of its first preset's real config.json values makes a random transformers model, saved with save_pretrained:
- cpumoe loads it, reading every tensor it holds (none left over, none missing);
- prefill logits agree (max |ours - theirs| / max |theirs|): fp32 within 1e-4; bf16 within 2e-2, or twice
  transformers' own bf16 error against its fp32 where that is larger (MLA's tiny bf16 models: 1-8%);
- 8 greedy steps without a cache give the same tokens;
- the engine's greedy tokens (paged cache) equal transformers.generate's, whole prompt and in chunks of 4 tokens.
The prompt is, of 16 seeded ones, the one whose k-th and (k+1)-th router logits lie furthest apart: a routing
near-tie that bf16 rounding flips moves the logits by ~10% in any implementation, and says nothing about cpumoe.
Architecture-specific variants and refusals live in the test_<model_type>.py files.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from cpumoe.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cpumoe.loader import Checkpoint  # noqa: E402
from cpumoe.models import ARCHITECTURES, CausalLM, load_model  # noqa: E402
from cpumoe.models.blocks import MoEBlock  # noqa: E402
from cpumoe.synthetic.checkpoint import build_config  # noqa: E402
from tests.models.tiny import greedy_without_cache, rel_err, spread_weights_  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
LAYERS, VOCAB, PROMPT_LEN = 3, 128, 11


def tiny_model(arch, dtype=torch.float32, **overrides):
    """make-model's tiny config of the architecture's first preset, then `overrides` (no eos: generate runs its
    full length)."""
    config = build_config(arch.presets[0].name, layers=LAYERS, vocab=VOCAB, dtype=torch.float32,
                          special_ids=dict(eos_token_id=None, pad_token_id=None, bos_token_id=None),
                          overrides={**arch.tiny, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, arch.hf_model_class)(config)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the plain per-expert loop, as the published code runs it
    spread_weights_(model)
    if dtype == torch.float32:
        return model.float().eval()
    fp32 = {n: t.clone() for n, t in model.state_dict().items() if arch.fp32_parameters and n.endswith(arch.fp32_parameters)}
    model = model.to(dtype)
    if fp32:  # as from_pretrained keeps them
        model.load_state_dict(fp32, strict=False, assign=True)
    return model.eval()


def router_margin(model, ids) -> float:
    """Smallest gap, over MoE layers and tokens, between the k-th and (k+1)-th largest router logit (inf where the
    model does not return its router logits)."""
    k = getattr(model.config, "num_experts_per_tok", None) or model.config.top_k_experts  # Gemma 4: top_k_experts
    try:
        with torch.no_grad():
            router_logits = model(ids, output_router_logits=True).router_logits  # per MoE layer [T, E]
    except (TypeError, ValueError, AttributeError):
        return float("inf")
    if not router_logits:
        return float("inf")
    top = [r.float().topk(k + 1, dim=-1).values for r in router_logits]  # [T, k + 1] each
    return min((t[:, k - 1] - t[:, k]).min().item() for t in top)


def stable_prompt(fp32_model) -> torch.Tensor:
    """Of 16 seeded prompts, the one whose routing is furthest from a tie."""
    prompts = [torch.randint(3, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
               for seed in range(16)]
    return max(prompts, key=lambda ids: router_margin(fp32_model, ids))


class Pair:
    def __init__(self, arch, root):
        self.arch = arch
        self.models = {dtype: tiny_model(arch, dtype) for dtype in TOL}
        self.paths = {}
        for dtype, model in self.models.items():
            self.paths[dtype] = root / str(dtype).removeprefix("torch.")
            model.save_pretrained(self.paths[dtype])
        self.ids = stable_prompt(self.models[torch.float32])
        with torch.no_grad():  # transformers' own bf16 error against its fp32
            self.bf16_err = rel_err(self.models[torch.bfloat16](self.ids).logits.float(),
                                    self.models[torch.float32](self.ids).logits)

    def tolerance(self, dtype) -> float:
        return TOL[dtype] if dtype == torch.float32 else max(TOL[dtype], 2 * self.bf16_err)


@pytest.fixture(scope="module", params=list(ARCHITECTURES), ids=list(ARCHITECTURES))
def pair(request, tmp_path_factory):
    return Pair(ARCHITECTURES[request.param], tmp_path_factory.mktemp(request.param))


def test_every_tensor_read_and_layers_assembled(pair):
    path = pair.paths[torch.float32]
    ckpt = Checkpoint(path)
    assert ckpt.model_type == pair.arch.model_type
    assert load_model(path).arch is pair.arch
    config = pair.arch.config(ckpt)
    with torch.device("meta"):
        ours = CausalLM(pair.arch, config)  # the names the loader reads, before packing renames anything
    params = {name for name, _ in ours.named_parameters()}
    blocks = [(prefix, block) for prefix, block in ours.named_modules() if isinstance(block, MoEBlock)]
    assert blocks, "the tiny config has no MoE layer"
    experts = {f"{prefix}.{name}" for prefix, block in blocks for name, _ in pair.arch.expert_tensors(config, block)}
    fused = {f"{prefix}.{spec.fused}" for prefix, _ in blocks
             for spec in pair.arch.expert_weights(config).values() if spec.fused}
    on_disk = set(ckpt.keys())
    assert params <= on_disk, f"not in the checkpoint: {sorted(params - on_disk)[:5]}"
    assert experts <= on_disk or fused <= on_disk, f"experts not in the checkpoint: {sorted(experts - on_disk)[:5]}"
    unread = on_disk - params - experts - fused
    if ours.lm_head is None:
        unread.discard("lm_head.weight")
    assert not unread, f"checkpoint tensors cpumoe never reads: {sorted(unread)[:5]}"


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16"])
def test_prefill_logits_match(pair, dtype):
    theirs_model = pair.models[dtype]
    ours = load_model(pair.paths[dtype])  # dtype from config.json
    assert ours.model.embed_tokens.weight.dtype == dtype
    with torch.no_grad():
        theirs = theirs_model(pair.ids).logits.float()  # [1, T, V]
    out = ours(pair.ids)
    assert out.dtype == torch.float32 and out.shape == theirs.shape
    err = rel_err(out, theirs)
    assert err <= pair.tolerance(dtype), (f"{pair.arch.model_type} {dtype}: max abs diff / max |logit| = {err:.2e}; "
                                          f"transformers' bf16 against its fp32: {pair.bf16_err:.2e}")
    assert torch.equal(ours(pair.ids[0]), out[0])  # [T] input -> [T, V]


def test_greedy_decode_matches(pair):
    ours = load_model(pair.paths[torch.float32])
    ids_ours, ids_theirs = greedy_without_cache(ours, pair.models[torch.float32], pair.ids, steps=8)
    assert ids_ours == ids_theirs, pair.arch.model_type


@pytest.mark.parametrize("budget", [512, 4], ids=["whole-prompt", "chunks-of-4"])
def test_engine_greedy_matches_generate(pair, budget):
    model, ids = pair.models[torch.float32], pair.ids
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10)[0, ids.shape[1]:]
    engine = LLMEngine(pair.paths[torch.float32],
                       config=EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=budget))
    out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.new_token_ids == ref.tolist(), f"{pair.arch.model_type}, token budget {budget}"


def test_every_architecture_has_presets_and_a_tiny_config():
    for arch in ARCHITECTURES.values():
        assert arch.presets and arch.tiny, arch.model_type
        for preset in arch.presets:
            layer = arch.layer_preset(preset)
            assert layer.name == preset.name and 0 < layer.top_k <= layer.experts, (arch.model_type, layer)
