"""Builds cpumoe._C: the PyTorch-free kernel core plus the TORCH_LIBRARY registration.

One binary serves every x86-64 CPU: the base flags target plain x86-64, and each ISA unit (a file under
csrc/core/x86 or csrc/core/arm named kernels_<isa>.cpp) gets its own -m flags; the backend that runs is
chosen at run time from the CPU's features.
"""
import glob
import os
import platform

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# A literal, flags repeated: tests/kernels/arm/test_arm_qemu.py reads it with ast.literal_eval for its cross build.
ISA_FLAGS = {
    "kernels_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "kernels_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "kernels_avx512bf16.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                               "-mfma", "-mf16c"],
    "kernels_amx.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mamx-tile",
                        "-mamx-bf16", "-mfma", "-mf16c"],
    "quant_amx.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16",
                      "-mamx-tile", "-mamx-int8", "-mfma", "-mf16c", "-ffp-contract=off"],
    "attention_amx.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mamx-tile",
                          "-mamx-bf16", "-mfma", "-mf16c"],
    "prefill_attention_amx.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                                  "-mamx-tile", "-mamx-bf16", "-mfma", "-mf16c"],
    "attention_avx512bf16.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                                 "-mfma", "-mf16c"],
    # -ffp-contract=off: the A8 tiles repeat quant_generic's float operations exactly (see their headers)
    "quant_avx512vnni.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c",
                             "-ffp-contract=off"],
    "quant_avx512bf16.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                             "-mfma", "-mf16c"],
    "quant_avx2.cpp": ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"],
    # the elementwise ops' row loops are cloned per vector width (CPUMOE_VECTOR_CLONES): no clone may fuse a
    # multiply into an add that the base one rounds apart
    "norm.cpp": ["-ffp-contract=off"],
    "rope.cpp": ["-ffp-contract=off"],
    "softmax.cpp": ["-ffp-contract=off"],
    "kernels_neon.cpp": [],
    "quant_dotprod.cpp": ["-march=armv8.2-a+dotprod"],
    "quant_i8mm.cpp": ["-march=armv8.6-a+i8mm+dotprod"],
    "kernels_bfmmla.cpp": ["-march=armv8.6-a+bf16+i8mm"],
}


class BuildWithIsaUnits(BuildExtension):
    """Adds each ISA unit's flags to that file's compile command only."""

    def build_extension(self, ext):
        compile_one = self.compiler._compile

        def compile_with_isa_flags(obj, src, ext_, cc_args, extra_postargs, pp_opts):
            flags = ISA_FLAGS.get(os.path.basename(src), [])
            return compile_one(obj, src, ext_, cc_args, list(extra_postargs) + flags, pp_opts)

        self.compiler._compile = compile_with_isa_flags
        try:
            super().build_extension(ext)
        finally:
            self.compiler._compile = compile_one


arch_dir = {"x86_64": "x86", "AMD64": "x86", "aarch64": "arm", "arm64": "arm"}[platform.machine()]
sources = sorted(glob.glob("csrc/core/*.cpp") + glob.glob(f"csrc/core/{arch_dir}/*.cpp") + ["csrc/torch/ops.cpp"])
# A changed header rebuilds the extension (setuptools compares only sources and depends with the binary).
headers = sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.inc", recursive=True))

setup(
    ext_modules=[
        CppExtension(
            "cpumoe._C",
            sources,
            depends=headers,
            # -fopenmp: at::parallel_for is inlined from ATen's OpenMP header; without it, it runs serially.
            # The extension then shares the libgomp that torch has already loaded.
            extra_compile_args=["-O3", "-std=c++17", "-fno-math-errno", "-fopenmp", "-Wall", "-Wno-unused-function", "-Wno-psabi"],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildWithIsaUnits.with_options(use_ninja=False)},
)
