"""Thin wrappers over torch.ops.cpumoe.* plus their fake (meta) kernels, so the ops trace under
torch.compile. Inputs are checked in C++ (csrc/torch/ops.cpp); errors arrive as RuntimeError/ValueError."""
from __future__ import annotations

import math

import torch

from cpumoe import _C  # noqa: F401  (loads the library that registers torch.ops.cpumoe)

_BLOCK_COLS = 64
_W13_BLOCK_INTER = 32


def packed_shapes(hidden_size: int, inter_size: int, backend: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """((w13 blocks, elements per block), (w2 blocks, elements per block)) of one expert."""
    return _C.packed_shapes(hidden_size, inter_size, backend)


def pack_w13(w13: torch.Tensor, backend: str) -> torch.Tensor:
    """[E, 2I, H] (gate rows, then up rows) -> the kernel's blocked layout [E, Ip/32, 64*Kp]."""
    return torch.ops.cpumoe.pack_w13(w13, backend)


def pack_w2(w2: torch.Tensor, backend: str) -> torch.Tensor:
    """[E, H, I] -> the kernel's blocked layout [E, Hp/64, 64*Ip]."""
    return torch.ops.cpumoe.pack_w2(w2, backend)


def pack_w13_bias(bias: torch.Tensor, padded_inter: int) -> torch.Tensor:
    """[E, 2I] -> float32 [E, 2*Ip] in block order: per 32 intermediate columns, 32 gate then 32 up."""
    E, two_i = bias.shape
    inter = two_i // 2
    pad = padded_inter - inter
    gate = torch.nn.functional.pad(bias[:, :inter].float(), (0, pad))
    up = torch.nn.functional.pad(bias[:, inter:].float(), (0, pad))
    blocks = padded_inter // _W13_BLOCK_INTER
    return torch.cat([gate.view(E, blocks, _W13_BLOCK_INTER), up.view(E, blocks, _W13_BLOCK_INTER)], dim=2).reshape(
        E, 2 * padded_inter).contiguous()


def pack_w2_bias(bias: torch.Tensor, padded_hidden: int) -> torch.Tensor:
    """[E, H] -> float32 [E, Hp], zero-padded."""
    return torch.nn.functional.pad(bias.float(), (0, padded_hidden - bias.shape[1])).contiguous()


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, backend: str, activation: str = "silu",
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  expert_map: torch.Tensor | None = None, apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """The fused experts op over prepacked weights (see cpumoe.experts for who packs them)."""
    return torch.ops.cpumoe.fused_experts(
        hidden_states, w13, w2, topk_weights, topk_ids, backend=backend, activation=activation, w13_bias=w13_bias,
        w2_bias=w2_bias, expert_map=expert_map, apply_router_weight_on_input=apply_router_weight_on_input)


def pack_linear(weight: torch.Tensor, backend: str) -> torch.Tensor:
    """nn.Linear weight [N, K] -> the layout cpumoe.ops.linear reads (one expert's w2 of H = N, I = K)."""
    return torch.ops.cpumoe.pack_w2(weight.unsqueeze(0).contiguous(), backend)


def join_packed_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Packed linear weights (pack_linear, or pack_quant of one [N, K] matrix) of one packing and input width ->
    the packing of their rows joined in order, without repacking: a packing's blocks hold whole rows, so this
    needs each part's rows to fill its last block (ValueError otherwise)."""
    return _C.join_packed_rows(parts)


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, *, backend: str,
           out_features: int) -> torch.Tensor:
    """x [..., K] -> [..., out_features], the dtype of x, on the experts' w2 tiles of `backend`."""
    return torch.ops.cpumoe.linear(x, packed_weight, bias, backend=backend, out_features=out_features)


def quant_packed_shape(format: str, rows: int, cols: int, group_size: int, w13: bool,
                       symmetric: bool = False) -> tuple[int, int]:
    """(blocks, bytes per block) of one packed quantized matrix [rows, cols] (group_size 0: a whole row);
    symmetric: int4 packed without zero points, as pack_quant packs it when given none."""
    return _C.quant_packed_shape(format, rows, cols, group_size, w13, symmetric)


def pack_quant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *, format: str,
               group_size: int, w13: bool) -> torch.Tensor:
    """Canonical quantized weights (cpumoe.quant.QuantizedWeight tensors) [E, N, K] -> uint8 blocks
    [E, blocks, bytes] in csrc/core/quant.h's layout of `format` (one layout for every backend). int4 without
    zeros (symmetric, zero point 8) packs without them: its blocks hold the scales alone."""
    return torch.ops.cpumoe.pack_quant(qweight, scales, zeros, format=format, group_size=group_size, w13=w13)


def fused_experts_quant(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, backend: str, format: str, group_size: int,
                        activation: str = "silu", w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                        apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """The fused experts op over quantized weights packed by pack_quant."""
    return torch.ops.cpumoe.fused_experts_quant(
        hidden_states, w13, w2, topk_weights, topk_ids, backend=backend, format=format, group_size=group_size,
        activation=activation, w13_bias=w13_bias, w2_bias=w2_bias, expert_map=expert_map,
        apply_router_weight_on_input=apply_router_weight_on_input)


def linear_quant(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, *, backend: str,
                 format: str, group_size: int, out_features: int) -> torch.Tensor:
    """x [..., K] -> [..., out_features] over a quantized weight packed by pack_quant(w13=False)."""
    return torch.ops.cpumoe.linear_quant(x, packed_weight, bias, backend=backend, format=format,
                                         group_size=group_size, out_features=out_features)


def experts_kernel_clock() -> tuple[int, float]:
    """(calls, seconds): the fused experts calls (fused_experts, fused_experts_quant) the calling thread has made
    so far, and the seconds the last one spent in its native kernel, without the Python, dispatcher and routing
    around it (bench layer reports both)."""
    calls, ns = _C.fused_moe_clock()
    return calls, ns * 1e-9


def route(router_logits: torch.Tensor, top_k: int, *, scoring: str, renormalize: bool,
          bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing without expert groups in one call: (weights float32 [M, k], ids int32 [M, k]).
    cpumoe.routing.select_experts documents the maths and calls this when it applies."""
    return torch.ops.cpumoe.route(router_logits, top_k, scoring, renormalize, bias, routed_scaling_factor)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     key_begin: torch.Tensor, key_end: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None = None, backend: str = "") -> torch.Tensor:
    """q [S, nh, d] (one token per sequence) over caches [blocks, block_size, nkv, d | dv]: each sequence's keys
    [key_begin, key_end) of its block_table [S, n] (positions over the table), -> [S, nh, dv] in q's dtype.
    A cache may be a view of each slot's leading channels (MLA: v_cache = k_cache[..., :c]). Each row's result
    depends only on its query, its keys and [key_begin, key_end): never on the other rows (batch-invariant).
    backend: one of attention_backends() (default: the first, the fastest here)."""
    return torch.ops.cpumoe.decode_attention(q, k_cache, v_cache, block_table, key_begin, key_end, scale, sinks,
                                             backend)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, weight_in_float: bool = False) -> torch.Tensor:
    """RMSNorm over x's last dimension in one pass (csrc/core/norm.h): weight * (x / rms(x)), rounded to x's dtype
    before the weight (Llama, Qwen) or after it (weight_in_float: gpt-oss). weight: x's dtype, [x.shape[-1]]."""
    return torch.ops.cpumoe.rms_norm(x, weight, eps, weight_in_float)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 weight_in_float: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass: the residual add before a pre-norm. The sum is rounded
    to x's dtype as torch's add rounds it, so both equal `s = x + residual; rms_norm(s, ...)` bit for bit.
    residual: x's shape and dtype, contiguous."""
    return torch.ops.cpumoe.add_rms_norm(x, residual, weight, eps, weight_in_float)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   norm_eps: float = 1e-6) -> None:
    """RoPE (rotate_half) on q [T, nh, d] and k [T, nkv, d] in place with cos, sin [T, d], then k and v [T, nkv, dv]
    into the caches [blocks, block_size, nkv, d | dv] at slot_mapping [T] (csrc/core/rope.h); all in q's dtype,
    rounded as torch's elementwise ops round. With q_norm and k_norm (weights [d] in q's dtype), each head of q and
    k is first RMS-normalized as rms_norm does it (Qwen3's per-head q/k norm), bit for bit."""
    torch.ops.cpumoe.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, norm_eps)


def causal_softmax(scores: torch.Tensor, scale: float, first_query: int, first_key: int, *, window: int = 0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention probabilities of a prefill chunk in one pass (csrc/core/softmax.h): softmax over the last
    dimension of scores [heads, queries, keys] * scale, keys a query does not see masked out, in float32, rounded
    to the scores' dtype. Query i sits at position first_query + i, key j at first_key + j; a query sees the keys at
    or before its position, and with a window (> 0) only those after position - window. sinks: float32 [heads],
    a logit per head that joins the denominator only (gpt-oss)."""
    return torch.ops.cpumoe.causal_softmax(scores, scale, first_query, first_key, window, sinks)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, window: int = 0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One prefill chunk's causal attention in one pass (csrc/core/prefill_attention.h): q [nh, T, d] (the last T of
    the L key positions), k [nkv, L, d], v [nkv, L, dv], each with contiguous rows -> [nh, T, dv] (a view of
    token-major memory). A query sees the keys at or before its position, and with a window (> 0) only those after
    position - window; sinks: float32 [nh], a logit per head that joins the denominator only. Raises, saying why,
    where prefill_attention_refusal gives a reason."""
    return torch.ops.cpumoe.prefill_attention(q, k, v, scale, window, sinks)


def prefill_attention_backend() -> str:
    """The kernel backend that runs prefill_attention here ('' when none)."""
    return _C.prefill_attention_backend()


def prefill_attention_refusal(dtype: torch.dtype, d: int, dv: int) -> str:
    """Why prefill_attention cannot run chunks of this dtype and head sizes (d for q and k, dv for v) here, in
    words ('' when it can)."""
    return _C.prefill_attention_refusal(str(dtype).removeprefix("torch."), d, dv)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token: logits float32 [B, V] -> int64 [B], the first of equal maxima (as torch.argmax),
    or NO_TOKEN for a row that holds a NaN (csrc/core/greedy.h). One op where argmax and a NaN check were four."""
    return torch.ops.cpumoe.greedy_tokens(logits)


NO_TOKEN = -1  # greedy_tokens' id for a row with no most likely token (kNoToken)


def attention_backends() -> list[str]:
    """The kernel backends with a decode attention kernel that can run here, fastest first."""
    return list(_C.attention_backends())


def attention_scope(backend: str) -> str:
    """The calls `backend`'s decode attention hands to another backend's kernel, in words ('' when none)."""
    return _C.attention_scope(backend)


def next_huge_mapping() -> int:
    """The number the next buffer on memory of its own (packed weights, the KV cache) will take (they are numbered
    in mapping order)."""
    return _C.next_huge_mapping()


def huge_mappings_since(number: int) -> list[tuple[int, int]]:
    """[(address, bytes)] of the live buffers on memory of their own numbered `number` or later: what a loader
    packed or the KV cache took, for cpumoe.memory.advised_memory to read their share on huge pages."""
    return _C.huge_mappings_since(number)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor on memory of its own, advised for 2 MB pages and faulted in now (as the packed weights'
    buffers are): the KV cache, whose decode reads are scattered over many blocks and took a TLB miss every 4 KB."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return _C.zeros_on_huge_pages(nbytes).view(dtype).view(shape)


def release_free_memory() -> bool:
    """Return the C allocator's free memory to the OS (glibc malloc_trim); loaders call it between phases."""
    return _C.release_free_memory()


def cpu_features() -> list[str]:
    return list(_C.cpu_features())


def measure_read_bandwidth(nbytes: int = 1 << 30, repetitions: int = 5) -> tuple[float, float]:
    """(best, median) GB/s of a multi-threaded streaming read of a buffer of nbytes (torch's thread count)."""
    return _C.measure_read_bandwidth(nbytes, repetitions)


ReadBandwidthProbe = _C.ReadBandwidthProbe
# A decoder layer's decode step in one call over ops above (csrc/torch/decode_layer.inc; cpumoe/models/decode_layer.py)
DecodeLayer = _C.DecodeLayer
DecodeModel = _C.DecodeModel
LayerLinear = _C.LayerLinear


def _no_meta_weights(data: torch.Tensor, **weights: torch.Tensor | None) -> None:
    """Real activations against meta weights reach the fake kernel (the meta dispatch key wins), which would answer
    with uninitialized memory: refuse. All-meta inputs (shape tracing) and FakeTensorMode (whose tensors report
    their real device) pass."""
    if data.device.type != "meta":
        empty = [name for name, w in weights.items() if w is not None and w.device.type == "meta"]
        if empty:
            raise ValueError(f"{', '.join(empty)} {'is a meta tensor' if len(empty) == 1 else 'are meta tensors'} "
                             f"(shapes without data) while the activations are on {data.device}: load real weights")


@torch.library.register_fake("cpumoe::pack_w13")
def _pack_w13_fake(w13, backend):
    (blocks, elems), _ = packed_shapes(w13.shape[2], w13.shape[1] // 2, backend)
    return w13.new_empty((w13.shape[0], blocks, elems))


@torch.library.register_fake("cpumoe::pack_w2")
def _pack_w2_fake(w2, backend):
    _, (blocks, elems) = packed_shapes(w2.shape[1], w2.shape[2], backend)
    return w2.new_empty((w2.shape[0], blocks, elems))


@torch.library.register_fake("cpumoe::linear")
def _linear_fake(x, w, bias, *, backend, out_features):
    _no_meta_weights(x, w=w, bias=bias)
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("cpumoe::fused_experts")
def _fused_experts_fake(hidden_states, w13, w2, topk_weights, topk_ids, *, backend, activation, w13_bias=None,
                        w2_bias=None, expert_map=None, apply_router_weight_on_input=False):
    _no_meta_weights(hidden_states, w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias)
    return torch.empty_like(hidden_states)


@torch.library.register_fake("cpumoe::pack_quant")
def _pack_quant_fake(qweight, scales, zeros, *, format, group_size, w13):
    blocks, nbytes = quant_packed_shape(format, qweight.shape[1], qweight.shape[2], group_size, w13,
                                        symmetric=zeros is None and format == "int4_w4a16")
    return qweight.new_empty((qweight.shape[0], blocks, nbytes), dtype=torch.uint8)


@torch.library.register_fake("cpumoe::fused_experts_quant")
def _fused_experts_quant_fake(hidden_states, w13, w2, topk_weights, topk_ids, *, backend, format, group_size,
                              activation, w13_bias=None, w2_bias=None, expert_map=None,
                              apply_router_weight_on_input=False):
    _no_meta_weights(hidden_states, w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias)
    return torch.empty_like(hidden_states)


@torch.library.register_fake("cpumoe::linear_quant")
def _linear_quant_fake(x, w, bias, *, backend, format, group_size, out_features):
    _no_meta_weights(x, w=w, bias=bias)
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("cpumoe::route")
def _route_fake(router_logits, top_k, scoring, renormalize, bias, routed_scaling_factor):
    _no_meta_weights(router_logits, e_score_correction_bias=bias)
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int32)


@torch.library.register_fake("cpumoe::decode_attention")
def _decode_attention_fake(q, k_cache, v_cache, block_table, key_begin, key_end, scale, sinks, backend=""):
    _no_meta_weights(q, k_cache=k_cache, v_cache=v_cache, sinks=sinks)
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[3]))


@torch.library.register_fake("cpumoe::rope_and_cache")
def _rope_and_cache_fake(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm=None, k_norm=None,
                         norm_eps=1e-6):
    _no_meta_weights(q, k_cache=k_cache, v_cache=v_cache, q_norm=q_norm, k_norm=k_norm)


@torch.library.register_fake("cpumoe::causal_softmax")
def _causal_softmax_fake(scores, scale, first_query, first_key, window, sinks):
    _no_meta_weights(scores, sinks=sinks)
    return torch.empty_like(scores)


@torch.library.register_fake("cpumoe::add_rms_norm")
def _add_rms_norm_fake(x, residual, weight, eps, weight_in_float=False):
    _no_meta_weights(x, weight=weight)
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake("cpumoe::prefill_attention")
def _prefill_attention_fake(q, k, v, scale, window, sinks):
    _no_meta_weights(q, k=k, v=v, sinks=sinks)
    return q.new_empty(q.shape[1], q.shape[0], v.shape[2]).transpose(0, 1)


@torch.library.register_fake("cpumoe::greedy_tokens")
def _greedy_tokens_fake(logits):
    return logits.new_empty(logits.shape[:1], dtype=torch.long)


@torch.library.register_fake("cpumoe::rms_norm")
def _rms_norm_fake(x, weight, eps, weight_in_float=False):
    _no_meta_weights(x, weight=weight)
    return torch.empty_like(x)
