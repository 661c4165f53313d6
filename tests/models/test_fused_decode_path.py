"""The model's fused path, against the modules and ops it replaces:
- packed_linear.join_linears (ops.join_packed_rows): q, k and v joined into one packed GEMM are the packing of
  their rows concatenated, byte for byte, for every native backend and dtype and every quantized format; parts
  that cannot join say why; a loaded model runs its attention on the joined GEMM where the shapes allow;
- the per-head q/k RMSNorm inside rope_and_cache: the paged forward gives the same output and cache bytes as with
  the norm modules;
- the residual adds inside the RMSNorms after them (DecoderLayer.forward_residual): every architecture's logits,
  bit for bit those of its layers' plain forward."""
import logging

import pytest
import torch

from cpumoe import ops
from cpumoe.models import ARCHITECTURES
from cpumoe.models.packed_linear import PackedLinear, QuantizedLinear, join_linears
from cpumoe.quant import concat_rows, quantize
from tests.kernels.moe_cases import backend_dtype_grid
from tests.kernels.test_quant_fused_moe import grid as quant_grid

NATIVE = [p for p in backend_dtype_grid() if p.values[0] != "naive"]
ROWS = (256, 64, 64)  # q, k, v of a GQA layer: 8 heads over 2 of 32


def weights(rows, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, K, generator=g) / K**0.5 for n in rows]


@pytest.mark.parametrize("backend,dtype", NATIVE)
@pytest.mark.parametrize("K", [64, 200], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("bias", ["none", "all", "v only"])
def test_joined_dense_weight_is_the_packing_of_the_rows_joined(backend, dtype, K, bias):
    ws = [w.to(dtype) for w in weights(ROWS, K)]
    biases = [None if bias == "none" or (bias == "v only" and i < 2) else torch.randn(n).to(dtype)
              for i, n in enumerate(ROWS)]
    parts = [PackedLinear(w, b, backend) for w, b in zip(ws, biases)]
    joined = join_linears(parts)
    whole = PackedLinear(torch.cat(ws), None, backend)
    assert torch.equal(joined.packed_weight, whole.packed_weight)
    assert (joined.out_features, joined.in_features, joined.backend) == (sum(ROWS), K, backend)
    x = torch.randn(5, K).to(dtype)
    want = torch.cat([p(x) for p in parts], dim=-1)  # each part alone, its bias included
    assert torch.equal(joined(x), want)


@pytest.mark.parametrize("backend,fmt,group,sym,dtype", quant_grid())
def test_joined_quantized_weight_is_the_packing_of_the_rows_joined(backend, fmt, group, sym, dtype):
    K = 128
    kw = dict(symmetric=sym) if fmt == "int4_w4a16" else {}
    qws = [quantize(w, fmt, K if group == 0 else group, **kw) for w in weights(ROWS, K, seed=1)]
    parts = [QuantizedLinear(qw, has_bias=False, dtype=dtype, backend=backend) for qw in qws]
    joined = join_linears(parts)
    whole = QuantizedLinear(concat_rows(qws), has_bias=False, dtype=dtype, backend=backend)
    assert torch.equal(joined.packed_weight, whole.packed_weight)
    assert (joined.format, joined.group_size, joined.backend) == (whole.format, whole.group_size, backend)
    x = torch.randn(3, K).to(dtype)
    assert torch.equal(joined(x), whole(x))


def test_parts_that_cannot_join_say_why():
    backend, dtype = NATIVE[0].values
    ragged = [PackedLinear(w.to(dtype), None, backend) for w in weights((100, 28), 64)]
    with pytest.raises(ValueError, match="parts\\[0\\] has 100 rows, not a multiple of the .* rows of a packed block"):
        join_linears(ragged)
    widths = [PackedLinear(w.to(dtype), None, backend) for w in weights((64,), 64) + weights((64,), 96)]
    with pytest.raises(ValueError, match="only linear weights of one packing and input width join"):
        join_linears(widths)
    int8 = QuantizedLinear(quantize(weights((64,), 64)[0], "int8_w8a8"), has_bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="only cpumoe's packed projections of one kind join"):
        join_linears([PackedLinear(torch.randn(64, 64), None), int8])
    with pytest.raises(ValueError, match="only cpumoe's packed projections"):
        join_linears([torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)])
    with pytest.raises(ValueError, match="not a weight packed by cpumoe"):
        ops.join_packed_rows([ragged[0].packed_weight.clone()])


def test_a_loaded_model_runs_q_k_v_as_one_gemm(tmp_path, caplog, monkeypatch):
    """The Qwen3-MoE layout (8 x 32 query rows, 2 x 32 key/value rows: whole blocks) joins in every layer, and the
    logits equal those of the same model with its three projections (the join changes no byte)."""
    import cpumoe.models as models
    from cpumoe.models.blocks import Attention
    from cpumoe.synthetic.checkpoint import make_checkpoint
    path = make_checkpoint("qwen3-30b-a3b", tmp_path / "m", layers=2, vocab=512, overrides=dict(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=64,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2))
    with caplog.at_level(logging.INFO, logger="cpumoe"):
        model = models.load_model(path)
    assert "q/k/v projections run as one GEMM in 2 of 2 attention layers" in caplog.text
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert all(a.qkv_proj is not None and a.q_proj is None for a in attentions)
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(models, "_join_projections", lambda m: None)
    separate = models.load_model(path)
    assert separate.model.layers[0].self_attn.qkv_proj is None
    assert torch.equal(model(ids), separate(ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "f16"])
@pytest.mark.parametrize("query_lens,context_lens", [([1], [9]), ([1, 1, 1], [5, 17, 2]), ([6, 1], [6, 13])],
                         ids=["decode", "decodes", "prefill+decode"])
def test_fused_head_norms_match_the_norm_modules(dtype, query_lens, context_lens):
    from cpumoe.models.blocks import Attention, QKNorm
    from tests.engine.paged import paged_case
    nh, nkv, d, H = 4, 2, 32, 64
    g = torch.Generator().manual_seed(3)
    attention = Attention(hidden_size=H, num_heads=nh, num_kv_heads=nkv, head_dim=d, rope_theta=1e6,
                          qk_norm=QKNorm.HEAD, norm_eps=1e-6)
    for p in attention.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0)).to(dtype)
    _, k_cache, v_cache, context = paged_case(query_lens, context_lens, nh=nh, nkv=nkv, d=d, dtype=dtype)
    T = sum(query_lens)
    positions = [torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)]  # each sequence's new tokens
    context.positions = torch.cat(positions)
    block_size = k_cache.shape[1]
    context.slot_mapping = torch.cat([table[p // block_size] * block_size + p % block_size
                                      for table, p in zip(context.block_tables, positions)])
    x = torch.randn(T, H, generator=g).to(dtype)
    assert attention._fused_head_norms(dtype) is not None
    fused_caches = [(k_cache.clone(), v_cache.clone())]
    context.kv_caches, context.cache = fused_caches, {}
    fused = attention(x, context.positions, context)
    attention._head_norms_fusable = False  # the norm modules, then rope_and_cache without norms
    context.kv_caches, context.cache = [(k_cache, v_cache)], {}
    modules = attention(x, context.positions, context)
    assert torch.equal(fused, modules)
    assert torch.equal(fused_caches[0][0], k_cache) and torch.equal(fused_caches[0][1], v_cache)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_residual_adds_in_the_norms_change_no_bit(model_type, tmp_path):
    """Every architecture built of DecoderLayers with RMSNorms runs its residual adds in the norms (the others keep
    their own layers); either way the logits equal the plain layers' bit for bit, in bf16 where the add rounds."""
    from cpumoe.models import load_model
    from cpumoe.models.architecture import DecoderLayer
    from tests.models.test_conformance import tiny_model
    arch = ARCHITECTURES[model_type]
    tiny_model(arch, torch.bfloat16).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    layers = model.model.layers
    plain_rmsnorm_decoder = all(type(layer) is DecoderLayer and type(layer.input_layernorm).__name__.endswith("RMSNorm")
                                for layer in layers)
    assert model.model.adds_in_norms == plain_rmsnorm_decoder, model_type
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    fused = model(ids)
    model.model._adds_in_norms = False
    assert torch.equal(fused, model(ids)), model_type
