# The Arm kernel backends (arm-neon, arm-bfmmla, the quantized ones, and decode attention) against the references,
# run under qemu-aarch64 on any host:
# the PyTorch-free core and driver.cpp are cross-compiled once per module into a static binary, each case's
# inputs (tests/kernels/moe_cases.py) are written as raw arrays, and the driver's output is held to the
# kernel tests' tolerance table. Needs aarch64-linux-gnu-g++ and qemu-aarch64-static (Debian:
# g++-aarch64-linux-gnu, qemu-user-static); without them the module is skipped, except under CI, where that
# is a failure.
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cpumoe import reference
from cpumoe.attention import decode_attention_reference
from tests.kernels.moe_cases import MoECase, MoEProblem, make_problem
from tests.kernels.test_decode_attention import CASES as ATTENTION_CASES
from tests.kernels.test_decode_attention import make_case as make_attention_case
from tests.kernels.tolerances import assert_moe_close

ROOT = Path(__file__).resolve().parents[3]
CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64-static"
CXXFLAGS = ["-O2", "-std=c++17", "-Wall", "-Wno-unused-function", f"-I{ROOT / 'csrc'}"]

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
KERNEL_DTYPES = [("arm-neon", torch.float32), ("arm-neon", torch.bfloat16), ("arm-neon", torch.float16),
                 ("arm-bfmmla", torch.bfloat16)]


def _isa_flags() -> dict[str, list[str]]:
    """setup.py's per-file ISA_FLAGS, read without running setup(), so the cross build matches the real one."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ISA_FLAGS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no ISA_FLAGS")


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def binaries(tmp_path_factory) -> dict[str, Path]:
    """The core + its Arm units, cross-compiled once and linked into two static aarch64 binaries: driver.cpp
    (whole fused layers) and quant_tiles.cpp (the quantized tiles alone)."""
    missing = [tool for tool in (CXX, QEMU) if shutil.which(tool) is None]
    if missing:
        reason = f"{' and '.join(missing)} not installed (Debian packages g++-aarch64-linux-gnu, qemu-user-static)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(reason)
        pytest.skip(reason)
    build = tmp_path_factory.mktemp("arm-build")
    isa_flags = _isa_flags()
    core = sorted([*(ROOT / "csrc/core").glob("*.cpp"), *(ROOT / "csrc/core/arm").glob("*.cpp")])
    mains = [Path(__file__).with_name("driver.cpp"), Path(__file__).with_name("quant_tiles.cpp")]

    def compile_one(src: Path) -> Path:
        obj = build / f"{src.stem}.o"
        _run([CXX, *CXXFLAGS, *isa_flags.get(src.name, []), "-c", str(src), "-o", str(obj)], f"compiling {src.name}")
        return obj

    with ThreadPoolExecutor(max_workers=2) as pool:
        objects = list(pool.map(compile_one, core + mains))
    binaries = {}
    for main, obj in zip(mains, objects[len(core):]):
        binaries[main.stem] = build / main.stem
        _run([CXX, "-static", "-pthread", *map(str, objects[:len(core)]), str(obj), "-o", str(binaries[main.stem])],
             f"linking {main.stem}")
    return binaries


@pytest.fixture(scope="module")
def driver(binaries) -> Path:
    return binaries["driver"]


def _backends(driver: Path, cpu: str) -> dict[str, str]:
    """{backend name: "available" | "unavailable, <why>"} as the driver reports them on qemu's `cpu` model."""
    out = _run([QEMU, "-cpu", cpu, str(driver)], f"driver on -cpu {cpu}")
    return dict(re.findall(r"^backend (\S+): (.*)$", out, flags=re.M))


def _tiles(driver: Path, cpu: str) -> dict[str, list[str]]:
    """{backend name: its tiles ("dense" and quantized format names)} for the backends that can run on `cpu`."""
    out = _run([QEMU, "-cpu", cpu, str(driver)], f"driver on -cpu {cpu}")
    return {name: tiles.split() for name, tiles in re.findall(r"^tiles (\S+):(.*)$", out, flags=re.M)}


def test_backends_available_on_cpu_max(driver):
    backends = _backends(driver, "max")
    for name in ("arm-bfmmla", "arm-i8mm", "arm-dotprod", "arm-neon"):
        assert backends[name] == "available", backends
    tiles = _tiles(driver, "max")
    assert tiles["arm-i8mm"] == tiles["arm-dotprod"] == ["int8_w8a8", "int4_w4a16", "mxfp4_w4a16"], tiles


def test_bfmmla_unavailable_without_bf16(driver):
    backends = _backends(driver, "cortex-a57")  # Armv8.0: NEON only
    assert "CPU lacks bf16" in backends["arm-bfmmla"], backends
    assert "CPU lacks i8mm" in backends["arm-i8mm"], backends
    assert "CPU lacks asimddp" in backends["arm-dotprod"], backends
    assert backends["arm-neon"] == "available", backends


def test_i8mm_unavailable_on_dotprod_cpu(driver):
    backends = _backends(driver, "cortex-a76")  # Armv8.2 + dotprod, no i8mm or bf16
    assert "CPU lacks i8mm" in backends["arm-i8mm"], backends
    assert backends["arm-dotprod"] == "available", backends


@pytest.mark.parametrize("cpu", ["max", "cortex-a76"])
def test_quant_tiles_match_scalar_reference(binaries, cpu):
    """Every Arm A8 tile (row counts 1..9, int4 groups, activations, bias, row_scale, w2 edge) against a scalar
    float64 reading of quant.h, within 1e-5 of each tile's largest |reference|; cortex-a76 runs arm-dotprod
    alone (it lacks i8mm)."""
    out = _run([QEMU, "-cpu", cpu, str(binaries["quant_tiles"]), "1e-5"], f"quant_tiles on -cpu {cpu}")
    assert out.rstrip().endswith("ok"), out
    assert ("arm-i8mm: skipped" in out) == (cpu != "max"), out


@dataclass(frozen=True)
class Case:
    shape: MoECase
    activation: str = "silu"
    bias: bool = False
    # or "expert_map" (shard holds SHARD), "one_expert", "skewed" (3 of 4 tokens pick expert 0 first),
    # "weight_on_input" (k == 1)
    routing: str = "topk"

    def __str__(self) -> str:
        return "-".join([self.shape.id, self.activation, *(["bias"] if self.bias else []),
                         *([self.routing] if self.routing != "topk" else [])])


SHARD = [1, 4, 6]  # global experts held by this shard in the expert_map case, as local experts 0, 1, 2
SHAPES = [MoECase(1, 64, 32, 4, 2), MoECase(7, 130, 70, 8, 2), MoECase(33, 96, 40, 8, 8), MoECase(5, 63, 17, 3, 1)]
CASES = [
    *(Case(shape) for shape in SHAPES),
    *(Case(SHAPES[1], activation=act) for act in ("gelu", "gelu_tanh", "swigluoai")),
    Case(SHAPES[1], bias=True),
    Case(SHAPES[3], activation="swigluoai", bias=True),
    Case(MoECase(29, 64, 48, 8, 2), routing="expert_map"),
    # One expert's rows in one tile call: 13 and 15 end in arm-bfmmla's 5- and 7-row tiles (the random
    # cases cover the others); 300 rows make several row chunks.
    *(Case(MoECase(M, 64, 40, 16, 1), routing="one_expert") for M in (13, 15, 300)),
    Case(MoECase(9, 64, 40, 4, 1), routing="weight_on_input"),
]


def _problem(case: Case, dtype: torch.dtype) -> tuple[MoEProblem, torch.Tensor | None]:
    """The case's inputs (local experts only) and its expert_map, if any."""
    s = case.shape
    if case.routing == "one_expert":
        return make_problem(s, dtype, bias=case.bias, topk_ids=torch.full((s.M, s.k), s.E - 1)), None
    if case.routing == "skewed":  # token t: experts base, base + 1, ... (mod E), base = 0 for 3 of 4 tokens
        base = torch.where(torch.arange(s.M) % 4 == 0, torch.arange(s.M) % s.E, 0)
        return make_problem(s, dtype, bias=case.bias, topk_ids=(base[:, None] + torch.arange(s.k)) % s.E), None
    p = make_problem(s, dtype, bias=case.bias)
    if case.routing != "expert_map":
        return p, None
    p.w13, p.w2 = p.w13[SHARD].contiguous(), p.w2[SHARD].contiguous()
    if case.bias:
        p.w13_bias, p.w2_bias = p.w13_bias[SHARD].contiguous(), p.w2_bias[SHARD].contiguous()
    expert_map = torch.full((s.E,), -1, dtype=torch.int32)
    expert_map[SHARD] = torch.arange(len(SHARD), dtype=torch.int32)
    return p, expert_map


def _write_case(directory: Path, kernel: str, dtype: torch.dtype, case: Case, p: MoEProblem,
                expert_map: torch.Tensor | None) -> None:
    E, I = p.w2.shape[0], p.w2.shape[2]  # noqa: E741
    meta = dict(kernel=kernel, dtype=DTYPE_NAMES[dtype], activation=case.activation, M=case.shape.M,
                H=case.shape.H, I=I, E=E, topk=case.shape.k,
                global_experts=len(expert_map) if expert_map is not None else E, w13_bias=int(case.bias),
                w2_bias=int(case.bias), expert_map=int(expert_map is not None),
                router_weight_on_input=int(case.routing == "weight_on_input"))
    (directory / "meta.txt").write_text("".join(f"{key} {value}\n" for key, value in meta.items()))
    arrays = dict(hidden=p.x, w13=p.w13, w2=p.w2, topk_weights=p.topk_weights.float(), topk_ids=p.topk_ids.int(),
                  expert_map=expert_map, w13_bias=p.w13_bias, w2_bias=p.w2_bias)
    for name, t in arrays.items():
        if t is None:
            continue
        if name.endswith("_bias"):
            t = t.float()  # the driver takes float32 biases, as the packed op does
        t.contiguous().flatten().view(torch.uint8).numpy().tofile(directory / f"{name}.bin")


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES, ids=[f"{k}-{DTYPE_NAMES[d]}" for k, d in KERNEL_DTYPES])
def test_fused_moe_matches_reference(driver, tmp_path, kernel, dtype, case):
    p, expert_map = _problem(case, dtype)
    _write_case(tmp_path, kernel, dtype, case, p, expert_map)
    _run([QEMU, "-cpu", "max", str(driver), str(tmp_path)], f"driver on {kernel} {case}")
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=dtype).view(case.shape.M, -1)
    ref = reference.fused_experts(p.x, p.w13, p.w2, p.topk_weights, p.topk_ids, activation=case.activation,
                                  w13_bias=p.w13_bias, w2_bias=p.w2_bias, expert_map=expert_map,
                                  apply_router_weight_on_input=case.routing == "weight_on_input")
    assert_moe_close(out, ref, dtype, f"{kernel} {DTYPE_NAMES[dtype]} {case}")


# ---- quantized weights: canonical cpumoe.quant tensors packed by the driver (quant_pack.cpp) ----

QUANT_BACKENDS = ["arm-i8mm", "arm-dotprod", "generic"]
# Errors relative to the largest |reference| (as assert_moe_close measures them). The reference quantizes the
# activations as the kernels do, so what differs is float32 summation order, and through it an intermediate
# value that lands on the other side of an int8 rounding boundary now and then (one code step of one row,
# ~1/254 of that row's largest value): float32 outputs stay well inside 1e-3; bf16 ones also round.
QUANT_TOLERANCES = {torch.float32: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


@dataclass(frozen=True)
class QuantCase:
    case: Case
    format: str            # int8_w8a8 | int4_w4a16 | mxfp4_w4a16
    group: int = 0         # int4 group of w13 and w2 (0: a whole row); mxfp4's is always 32
    symmetric: bool = True  # int4: zero 8, else zero points
    dtype: torch.dtype = torch.bfloat16

    def __str__(self) -> str:
        fmt = self.format if self.format != "int4_w4a16" else \
            f"int4-g{self.group or 'row'}{'' if self.symmetric else '-asym'}"
        return f"{fmt}-{DTYPE_NAMES[self.dtype]}-{self.case}"


QUANT_CASES = [
    QuantCase(Case(MoECase(1, 64, 32, 4, 2)), "int8_w8a8"),  # decode: one row per expert
    QuantCase(Case(MoECase(1, 64, 32, 4, 2)), "int4_w4a16", group=32),
    QuantCase(Case(MoECase(7, 130, 70, 8, 2), bias=True), "int8_w8a8", dtype=torch.float32),  # odd H, I: padding
    QuantCase(Case(MoECase(7, 130, 70, 8, 2), activation="gelu"), "int4_w4a16", symmetric=False),
    QuantCase(Case(MoECase(5, 63, 17, 3, 1), activation="swigluoai", bias=True), "int4_w4a16", dtype=torch.float32),
    QuantCase(Case(MoECase(33, 96, 64, 8, 8), activation="gelu_tanh"), "int4_w4a16", group=32, symmetric=False,
              dtype=torch.float32),
    QuantCase(Case(MoECase(40, 128, 64, 8, 2), routing="skewed"), "int8_w8a8"),
    QuantCase(Case(MoECase(40, 128, 64, 8, 2), routing="skewed"), "int4_w4a16", group=64),
    QuantCase(Case(MoECase(29, 64, 64, 8, 2), routing="expert_map"), "int4_w4a16", group=64, dtype=torch.float32),
    # One expert's 13 rows: arm-i8mm's 8 + 5 row tiles, arm-dotprod's 4 + 4 + 4 + 1.
    QuantCase(Case(MoECase(13, 64, 64, 16, 1), routing="one_expert"), "int8_w8a8", dtype=torch.float32),
    QuantCase(Case(MoECase(15, 128, 128, 16, 1), routing="one_expert"), "int4_w4a16", group=128, dtype=torch.float32),
    QuantCase(Case(MoECase(9, 64, 32, 4, 1), routing="weight_on_input"), "int8_w8a8"),
    QuantCase(Case(MoECase(1, 64, 32, 4, 2)), "mxfp4_w4a16"),
    QuantCase(Case(MoECase(5, 64, 32, 3, 1), activation="swigluoai", bias=True), "mxfp4_w4a16", dtype=torch.float32),
    QuantCase(Case(MoECase(40, 128, 64, 8, 2), routing="skewed"), "mxfp4_w4a16"),
    QuantCase(Case(MoECase(13, 96, 64, 16, 1), routing="one_expert"), "mxfp4_w4a16", dtype=torch.float32),
]


def _quantize(w: torch.Tensor, qc: QuantCase):
    from cpumoe.quant import quantize
    if qc.format in ("int8_w8a8", "mxfp4_w4a16"):
        return quantize(w, qc.format)
    return quantize(w, "int4_w4a16", group_size=qc.group or w.shape[-1], symmetric=qc.symmetric)


def _write_quant_case(directory: Path, kernel: str, qc: QuantCase, p: MoEProblem, w13q, w2q,
                      expert_map: torch.Tensor | None) -> None:
    _write_case(directory, kernel, qc.dtype, qc.case, p, expert_map)
    (directory / "w13.bin").unlink()
    (directory / "w2.bin").unlink()
    with open(directory / "meta.txt", "a") as meta:
        meta.write(f"quant {qc.format}\ngroup13 {qc.group}\ngroup2 {qc.group}\nzeros {int(w13q.zeros is not None)}\n")
    for prefix, w in (("w13", w13q), ("w2", w2q)):
        for name, t in (("codes", w.qweight), ("scales", w.scales), ("zeros", w.zeros)):
            if t is not None:
                t.contiguous().flatten().view(torch.uint8).numpy().tofile(directory / f"{prefix}_{name}.bin")


@pytest.mark.parametrize("qc", QUANT_CASES, ids=str)
@pytest.mark.parametrize("kernel", QUANT_BACKENDS)
def test_fused_moe_quant_matches_reference(driver, tmp_path, kernel, qc):
    p, expert_map = _problem(qc.case, qc.dtype)
    w13q, w2q = _quantize(p.w13, qc), _quantize(p.w2, qc)
    _write_quant_case(tmp_path, kernel, qc, p, w13q, w2q, expert_map)
    _run([QEMU, "-cpu", "max", str(driver), str(tmp_path)], f"driver on {kernel} {qc}")
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=qc.dtype).view(qc.case.shape.M, -1)
    ref = reference.quantized_fused_experts(p.x, w13q, w2q, p.topk_weights, p.topk_ids, activation=qc.case.activation,
                                            w13_bias=p.w13_bias, w2_bias=p.w2_bias, expert_map=expert_map,
                                            apply_router_weight_on_input=qc.case.routing == "weight_on_input")
    scale = max(ref.float().abs().max().item(), 1e-6)
    tol = QUANT_TOLERANCES[qc.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol["atol"] * scale, rtol=tol["rtol"],
                               msg=lambda m: f"{kernel} {qc}: {m}")


# ---- decode attention: the backend attention_kernel() picks on Arm, over the cases of test_decode_attention.py ----

def _write_attention_case(directory: Path, dtype: torch.dtype, q, k_cache, v_cache, batch, sink, scale) -> None:
    S, nh, d = q.shape
    meta = dict(op="attention", dtype=DTYPE_NAMES[dtype], S=S, nh=nh, nkv=k_cache.shape[2], d=d, dv=v_cache.shape[3],
                n=batch.block_table.shape[1], block_size=k_cache.shape[1], blocks=k_cache.shape[0],
                scale=repr(scale), sinks=int(sink is not None))
    (directory / "meta.txt").write_text("".join(f"{key} {value}\n" for key, value in meta.items()))
    arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=batch.block_table, key_begin=batch.key_begin,
                  key_end=batch.key_end, sinks=sink)
    for name, t in arrays.items():
        if t is not None:
            t.contiguous().flatten().view(torch.uint8).numpy().tofile(directory / f"{name}.bin")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"S{c[0]}-h{c[1]}x{c[2]}-d{c[3]}v{c[4]}-bs{c[5]}"
                                                                f"{'-w' + str(c[7]) if c[7] else ''}"
                                                                f"{'-sinks' if c[8] else ''}")
def test_decode_attention_matches_reference(driver, tmp_path, dtype, case):
    S, nh, nkv, d, dv, bs, lens, window, sinks = case
    q, k_cache, v_cache, batch, sink = make_attention_case(S, nh, nkv, d, dv, bs, lens, dtype, window, sinks=sinks)
    scale = d ** -0.5
    _write_attention_case(tmp_path, dtype, q, k_cache, v_cache, batch, sink, scale)
    out_text = _run([QEMU, "-cpu", "max", str(driver), str(tmp_path)], f"driver attention {case}")
    assert re.search(r"^attention (generic|arm-\S+)$", out_text, flags=re.M), out_text
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=dtype).view(S, nh, dv)
    ref = decode_attention_reference(q, k_cache, v_cache, batch, scale=scale, sinks=sink)
    assert_moe_close(out, ref, dtype, f"arm attention {case}")


def _greedy_cases() -> dict[str, torch.Tensor]:
    """Logits for greedy_tokens: vocabularies that fill and do not fill its 16 lanes, rows split over the pool,
    ties (the first), infinities, signed zeros and rows holding a NaN (no token)."""
    g = torch.Generator().manual_seed(5)
    cases = {f"random-{rows}x{vocab}": torch.randn(rows, vocab, generator=g) * 5
             for rows, vocab in [(1, 1), (1, 15), (1, 16), (1, 17), (3, 100), (1, 32771), (16, 32771)]}
    ties = torch.zeros(4, 100)
    ties[0, [3, 99]] = 2.0                    # two maxima: the first
    ties[1, [99, 98]] = 1.0                   # in the tail past the lanes
    ties[2] = float("-inf")                   # every token -inf: the first, as argmax
    ties[3, [5, 16]] = float("inf")           # +inf twice, in two lanes
    cases["ties"] = ties
    diagonal = torch.full((50, 50), -3.0)
    diagonal[torch.arange(50), torch.arange(50)] = 1.0  # row i: its maximum at i, in each lane and in the tail
    cases["every-position"] = diagonal
    cases["signed-zeros"] = torch.tensor([[-1.0] * 20 + [-0.0, 0.0], [-1.0] * 3 + [0.0] + [-1.0] * 16 + [-0.0, -1.0]])
    nan = torch.randn(20, 4000, generator=g)
    nan[3, 0] = nan[7, 3999] = nan[11, 16 * 100 + 5] = float("nan")  # in a lane, in the tail, deep in the row
    cases["nan-rows"] = nan
    return cases


def test_greedy_tokens_match_argmax(driver, tmp_path):
    """greedy.cpp's NEON passes (the x86 build runs SSE ones) against torch.argmax with the NaN check, every case
    in one run of the driver."""
    cases = _greedy_cases()
    for name, logits in cases.items():
        directory = tmp_path / name
        directory.mkdir()
        (directory / "meta.txt").write_text(f"op greedy\nrows {logits.shape[0]}\nvocab {logits.shape[1]}\n")
        logits.contiguous().numpy().tofile(directory / "logits.bin")
    _run([QEMU, "-cpu", "max", str(driver), *(str(tmp_path / name) for name in cases)], "driver greedy")
    for name, logits in cases.items():
        out = torch.frombuffer(bytearray((tmp_path / name / "out.bin").read_bytes()), dtype=torch.int64)
        expected = logits.argmax(dim=-1).masked_fill(torch.isnan(logits).any(dim=-1), -1)
        assert torch.equal(out, expected), f"{name}: {out.tolist()[:20]} against {expected.tolist()[:20]}"
