"""Compile kiln's Triton kernels for NVIDIA GPUs ahead of time, without a GPU: Triton's own
compiler (frontend, MLIR passes, LLVM, the ptxas it ships) down to a cubin, for each
specialisation the engine launches. Catches what the interpreter cannot (type and shape rules
of ``tl.dot`` on the tensor cores, layouts, register allocation). Run in its own process
(``TRITON_INTERPRET`` unset): ``python tests/unit/llm/triton_aot.py 90``."""

from __future__ import annotations

import os
import sys
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.llm.kernels import decode_attention as da
from kiln.llm.kernels import elementwise as ew

DT = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def compile_kernel(fn: Any, types: dict[str, str], constants: dict[str, Any], arch: int) -> Any:
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        else:
            signature[name] = types[name]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


def kernels(dtype: str) -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    p = DT[dtype]
    i32 = "i32"
    decode_types = {
        "out_ptr": p, "q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "token_index_ptr": "*i64",
        "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "scale": "fp32", "softcap": "fp32",
        "window": i32, "stride_qt": i32, "stride_qh": i32, "stride_ot": i32, "stride_oh": i32,
        "stride_kp": i32, "stride_ks": i32, "stride_kh": i32, "stride_vp": i32,
        "stride_vs": i32, "stride_vh": i32, "stride_bt": i32,
    }  # fmt: skip
    out = []
    # the tests' tiny model (GQA 2, head 16), the 1.1B benchmark model (GQA 4, head 64), and
    # a GQA-8 head-128 one (Llama-3-8B's)
    for group, dim in ((2, 16), (4, 64), (8, 128)):
        for softcap, window in ((False, False), (True, True)):
            constants = {
                "BLOCK_SIZE": 16, "GROUP": group, "GROUP_P": max(16, group), "HEAD_DIM": dim,
                "HEAD_DIM_P": dim, "TILE_N": da.TILE, "USE_SOFTCAP": softcap,
                "USE_WINDOW": window, "PRECISION": "ieee" if dtype == "fp32" else None,
                "UPCAST": False,
            }  # fmt: skip
            name = f"decode_attention g{group} d{dim} softcap={softcap} window={window}"
            out.append((name, da._paged_decode_kernel, decode_types, constants))
    norm_types = {
        "x_ptr": p,
        "residual_ptr": p,
        "weight_ptr": p,
        "out_ptr": p,
        "stride_x": i32,
        "stride_r": i32,
        "stride_o": i32,
        "n": i32,
        "eps": "fp32",
    }
    for add in (False, True):
        out.append((f"rms_norm add={add}", ew._rms_norm_kernel, norm_types,
                    {"ADD": add, "BLOCK": 2048}))  # fmt: skip
    out.append(("silu_and_mul", ew._silu_and_mul_kernel,
                {"x_ptr": p, "out_ptr": p, "stride_x": i32, "stride_o": i32, "n": i32},
                {"BLOCK": ew.SILU_BLOCK}))  # fmt: skip
    out.append(("rope", ew._rope_kernel,
                {"x_ptr": p, "cos_ptr": p, "sin_ptr": p, "stride_xt": i32, "stride_xh": i32,
                 "stride_ct": i32, "stride_st": i32, "heads": i32},
                {"HALF": 32, "HALF_P": 32, "HEADS_P": 64}))  # fmt: skip
    return out


def main(arch: int) -> int:
    failed = 0
    for dtype in ("bf16", "fp16", "fp32"):
        for name, fn, types, constants in kernels(dtype):
            try:
                compiled = compile_kernel(fn, types, constants, arch)
                assert compiled.asm.get("cubin"), "no cubin"
                shared = getattr(compiled.metadata, "shared", "?")
                print(f"ok   sm_{arch} {dtype} {name}: cubin {len(compiled.asm['cubin'])} B, "
                      f"shared memory {shared} B")  # fmt: skip
            except Exception as e:  # report every kernel, then fail
                failed += 1
                print(f"FAIL sm_{arch} {dtype} {name}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
