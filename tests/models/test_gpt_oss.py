"""gpt-oss against transformers: a tiny random GptOssForCausalLM (yarn RoPE, attention sinks, sliding layers with a
window of 4 keys alternating with full ones, biased router and experts, swigluoai) saved with save_pretrained and
loaded by cpumoe.models.load_model (the conformance test checks its logits and greedy tokens, as every
architecture's), and here: the engine with concurrent requests (paged KV cache, chunked prefill, windows across
blocks) generates what transformers' generate does. The same checkpoint with MXFP4
experts (published gpt-oss layout) loads and matches its dequantized twin exactly. Attention sinks and windows are
also checked alone, in paged_attention against a plain softmax reference.

The reference runs transformers' eager attention (sinks need it) and eager experts (its default is grouped_mm).
Tolerances, as max |ours - theirs| / max |theirs| over the logits: fp32 1e-4 (measured 3e-7), bf16 2e-2 (measured
9e-3; transformers' own bf16 run is 6e-3 from fp32 maths on the same bf16 weights).
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from cpumoe.loader import Checkpoint, CheckpointError, mxfp4  # noqa: E402
from cpumoe.models import ARCHITECTURES, load_model  # noqa: E402
from cpumoe.attention import paged_attention  # noqa: E402
from cpumoe.models.gpt_oss import GptOssMoE  # noqa: E402
from tests.models.tiny import rel_err  # noqa: E402
from tests.engine.paged import paged_case  # noqa: E402
from tests.models.tiny import engine_greedy, spread_weights_  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
A8_BUDGET = 0.01  # int8 activations per token; measured 0.0034 here (against the twin and transformers alike)
# 11 tokens: longer than the window, so sliding layers drop keys; no routing near-tie in bf16 (min_router_margin)
PROMPT = torch.tensor([[56, 59, 15, 24, 123, 9, 66, 71, 53, 69, 36]])  # [1, T]
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False}  # gpt-oss's own
BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=YARN,
            eos_token_id=None, pad_token_id=None)  # no eos: generate runs its full length
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def tiny_model(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**BASE, **overrides}))
    model.set_experts_implementation("eager")  # the plain per-expert loop, not grouped_mm
    assert model.config._attn_implementation == "eager"
    return spread_weights_(model).to(dtype).eval()


def save(model, path):
    model.save_pretrained(path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def to_mxfp4(src, dst):
    """src's checkpoint with its experts as published gpt-oss checkpoints store them: {gate_up_proj, down_proj}_blocks
    and _scales for W [E, out, in] (transformers' gate_up_proj [E, H, 2I] transposed, gate/up rows interleaved), the
    float expert tensors removed, and quantization_config in config.json."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith(EXPERT_TENSORS):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4.quantize(t.transpose(1, 2))  # [E, out, in]
        else:
            tensors[name] = t
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    edit_config(dst, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return dst


def dequantized_twin(src, mx, dst):
    """src's checkpoint with its expert weights replaced by the dequantized MXFP4 ones of `mx`, in transformers'
    layout (convert_moe_packed_tensors: what transformers' own MXFP4 loading gives)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(src, dst)
    tensors, packed = load_file(src / "model.safetensors"), load_file(mx / "model.safetensors")
    for name in tensors:
        if name.endswith(EXPERT_TENSORS):
            w = convert_moe_packed_tensors(packed[f"{name}_blocks"], packed[f"{name}_scales"], dtype=torch.float32)
            assert w.shape == tensors[name].shape, name
            tensors[name] = w.to(tensors[name].dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tiny_model()
    return model, save(model, tmp_path_factory.mktemp("gpt_oss_fp32"))


def test_registered_layers_and_names(pair):
    _, path = pair
    ckpt = Checkpoint(path)
    assert ckpt.model_type == "gpt_oss" and "gpt_oss" in ARCHITECTURES
    keys = set(ckpt.keys())
    for name in ("model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.bias",
                 "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias",
                 "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.down_proj_bias"):
        assert name in keys, f"save_pretrained wrote no {name}"
    assert ckpt.shape("model.layers.0.mlp.experts.gate_up_proj") == (8, 64, 64)  # [E, H, 2I]
    ours = load_model(path)
    attn = [layer.self_attn for layer in ours.model.layers]
    assert [a.sliding_window for a in attn] == [4, None, 4, None]
    assert all(a.sinks is not None and a.o_proj.bias is not None for a in attn)
    assert all(isinstance(layer.mlp, GptOssMoE) for layer in ours.model.layers)
    assert ours.model.layers[0].mlp.experts.config.activation == "swigluoai"
    assert ours.model.layers[0].self_attn.rotary.attention_factor > 1  # yarn
    assert ours.config.quantization is None


@pytest.mark.parametrize("drop", ["sinks", "window"])
def test_sinks_and_window_matter(pair, drop):
    """Without either feature the logits move far outside the tolerance: the conformance test does test them."""
    model, path = pair
    ours = load_model(path)
    for layer in ours.model.layers:
        if drop == "sinks":
            layer.self_attn.sinks = None
        else:
            layer.self_attn.sliding_window = None
    with torch.no_grad():
        theirs = model(PROMPT).logits
    assert rel_err(ours(PROMPT), theirs) > 100 * TOL[torch.float32], drop


PROMPTS = [PROMPT[0].tolist(), [5], [17, 99, 3], list(range(30, 52)), [7, 7, 7, 7, 7, 9]]


@pytest.fixture(scope="module")
def reference(pair):
    """transformers' greedy tokens (generate, its sliding-window KV cache) for each prompt alone."""
    model, _ = pair
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10)[0, len(p):].tolist()
                for p in PROMPTS]


@pytest.mark.parametrize("budget", [512, 7], ids=["budget-512", "budget-7"])
def test_engine_concurrent_requests_match_generate(pair, reference, budget):
    """Prompts of 1 to 22 tokens at once: decodes beside prefill chunks, windows across blocks."""
    outs = engine_greedy(pair[1], PROMPTS, budget=budget, num_blocks=96)
    for i, out in enumerate(outs):
        assert out == reference[i], f"prompt {i} (length {len(PROMPTS[i])}), token budget {budget}"


# --- MXFP4 experts -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mxfp4_paths(pair, tmp_path_factory):
    _, path = pair
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    mx = to_mxfp4(path, root / "mxfp4")
    return mx, dequantized_twin(path, mx, root / "dequantized")


def test_mxfp4_layout_is_transformers(mxfp4_paths):
    """cpumoe's dequantize reads blocks/scales as transformers' convert_moe_packed_tensors does."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    mx, _ = mxfp4_paths
    ckpt = Checkpoint(mx)
    keys = set(ckpt.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert ckpt.shape(f"{name}_blocks") == (8, 64, 2, 16) and ckpt.shape(f"{name}_scales") == (8, 64, 2)
    blocks, scales = ckpt.read(f"{name}_blocks"), ckpt.read(f"{name}_scales")
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, H, 2I]
    ours = mxfp4.dequantize(blocks, scales, torch.float32)  # [E, 2I, H]
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16).float(), ours)  # exact in bf16 too


def test_mxfp4_runs_natively_in_bf16(mxfp4_paths):
    """In bf16 the experts stay MXFP4 in memory (a native backend runs them, no dequantized copy) and agree with the
    dequantized twin within bf16's tolerance."""
    mx, deq = mxfp4_paths
    ours = load_model(mx, dtype=torch.bfloat16)
    blocks = [m for m in ours.modules() if isinstance(m, GptOssMoE)]
    assert blocks and all(b.experts.quantization == "mxfp4_w4a16" and b.experts.backend != "naive" for b in blocks)
    out, twin = ours(PROMPT).float(), load_model(deq, dtype=torch.bfloat16)(PROMPT).float()
    torch.testing.assert_close(out, twin, rtol=2e-2, atol=2e-2 * twin.abs().max().item())


def test_mxfp4_checkpoint_matches_dequantized(pair, mxfp4_paths):
    """In float32 too the experts run natively: MXFP4 computes as W4A8 (activations quantized to int8 per token,
    as the reference does), so the logits keep to the A8 budget against the dequantized twin and transformers."""
    model, _ = pair
    mx, deq = mxfp4_paths
    ours_mx = load_model(mx)
    assert ours_mx.config.quantization == "mxfp4"
    blocks = [m for m in ours_mx.modules() if isinstance(m, GptOssMoE)]
    assert blocks and all(b.experts.quantization == "mxfp4_w4a16" and b.experts.backend != "naive" for b in blocks)
    out = ours_mx(PROMPT)
    assert rel_err(out, load_model(deq)(PROMPT)) <= A8_BUDGET, "MXFP4 experts differ from their dequantized twin"
    theirs_model = transformers.GptOssForCausalLM.from_pretrained(deq, dtype=torch.float32,
                                                                  experts_implementation="eager").eval()
    with torch.no_grad():
        theirs = theirs_model(PROMPT).logits
    assert rel_err(out, theirs) <= A8_BUDGET
    with torch.no_grad():
        original = model(PROMPT).logits
    assert rel_err(out, original) > TOL[torch.float32]  # quantization did change the experts


def _copy_without(src, dst, drop: str):
    shutil.copytree(src, dst)
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items() if k != drop}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_mxfp4_missing_scales_names_the_tensor(mxfp4_paths, tmp_path):
    missing = "model.layers.2.mlp.experts.down_proj_scales"
    path = _copy_without(mxfp4_paths[0], tmp_path / "ckpt", missing)
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_model(path)


def test_mxfp4_misshaped_blocks_are_refused(mxfp4_paths, tmp_path):
    path = shutil.copytree(mxfp4_paths[0], tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    tensors[name] = tensors[name][:, :, :1].contiguous()  # half the blocks of each row
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    expected = rf"{name.replace('.', '[.]')}.*\[8, 64, 1, 16\].*expected \[8, 64, 2, 16\]"
    with pytest.raises(CheckpointError, match=expected):
        load_model(path)


def test_unsupported_quant_method_is_named(pair, tmp_path):
    path = shutil.copytree(pair[1], tmp_path / "ckpt")
    edit_config(path, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(CheckpointError, match="quant_method 'awq' is not supported"):
        load_model(path)


@pytest.mark.parametrize("edit, match", [
    (dict(swiglu_limit=10.0), "swiglu_limit=10.0"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "dynamic"),
], ids=["swiglu-limit", "layer-types-length", "rope-dynamic"])
def test_unsupported_configs_are_refused(pair, edit, match, tmp_path):
    path = shutil.copytree(pair[1], tmp_path / "ckpt")
    edit_config(path, **edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(path)


def test_published_config_keys(pair, tmp_path):
    """openai/gpt-oss-20b's config.json spells RoPE as rope_scaling + a top-level rope_theta (transformers 4) and
    has no swiglu_alpha: it reads as the same model."""
    model, path = pair
    path = shutil.copytree(path, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config.pop("swiglu_alpha")
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        theirs = model(PROMPT).logits
    assert rel_err(load_model(path)(PROMPT), theirs) <= TOL[torch.float32]


# --- paged attention with sinks and a sliding window ---------------------------------------------------------------

ATTENTION_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _paged_case(query_lens, context_lens, dtype, nh=4, nkv=2, d=16):
    """paged_case plus sink logits [nh]."""
    sinks = (torch.randn(nh, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    return (*paged_case(query_lens, context_lens, nh=nh, nkv=nkv, d=d, dtype=dtype), sinks)


def _eager_reference(q, k_cache, v_cache, context, sinks, window):
    """transformers' eager_attention_forward with sinks, sequence by sequence over its gathered context, in fp32."""
    q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    sinks = None if sinks is None else sinks.float()
    out, start = [], 0
    nh, nkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    for q_len, ctx, blocks in zip(context.query_lens, context.context_lens, context.block_tables):
        k = k_cache[blocks].reshape(-1, nkv, d)[:ctx].transpose(0, 1).repeat_interleave(nh // nkv, 0)  # [nh, ctx, d]
        v = v_cache[blocks].reshape(-1, nkv, d)[:ctx].transpose(0, 1).repeat_interleave(nh // nkv, 0)
        qi = q[start:start + q_len].transpose(0, 1)  # [nh, q_len, d]
        q_pos, k_pos = torch.arange(ctx - q_len, ctx)[:, None], torch.arange(ctx)[None, :]
        allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = (qi @ k.transpose(1, 2) * d ** -0.5).masked_fill(~allowed, float("-inf"))  # [nh, q_len, ctx]
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None, None].expand(-1, q_len, 1)], dim=-1)
        probs = scores.softmax(-1)[..., :ctx]
        out.append((probs @ v).transpose(0, 1))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize("query_lens,context_lens", [
    ([1], [1]), ([1], [17]), ([1, 1, 1], [5, 39, 2]),      # decodes only, windows across blocks
    ([1, 7, 1], [9, 7, 33]), ([5, 1], [13, 6]), ([11], [11]),  # decodes beside prefills and chunks
], ids=["one-token", "decode-17", "decodes-3", "mixed", "chunk-then-decode", "prefill-only"])
@pytest.mark.parametrize("sinks,window", [(True, None), (False, 5), (True, 5), (True, 1)],
                         ids=["sinks", "window-5", "sinks-window-5", "sinks-window-1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_sinks_and_window(query_lens, context_lens, sinks, window, dtype):
    q, k_cache, v_cache, context, sink_logits = _paged_case(query_lens, context_lens, dtype)
    sink_logits = sink_logits if sinks else None
    out = paged_attention(q, k_cache, v_cache, context, sinks=sink_logits, sliding_window=window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _eager_reference(q, k_cache, v_cache, context, sink_logits, window),
                               **ATTENTION_TOL[dtype], msg=f"query_lens {query_lens}, context_lens {context_lens}")
