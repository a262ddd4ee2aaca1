"""Static instruction counts of the T1 kernels, compiled for sm_90 on any machine (no GPU).

    python benchmarks/bench_sass.py                 # -> benchmarks/results/sass-cpu.json / .md

Triton compiles each kernel for an H100 / H200 (``GPUTarget("cuda", 90, 32)``) with the ptxas its wheel
carries, and its nvdisasm lists the SASS; the counts are per thread of one program (static: no loop runs
here), by opcode, with the shared memory the program takes, the registers a thread holds (cuobjdump) and the
programs an SM can hold by those registers alone (what bounds the bytes a memory-bound kernel keeps in
flight). A count is no speed: the bf16 store lost a third of its instructions on 2026-12-02 and gained 2-6 %
on the H200 (results README, T1 section); it shows what a formulation removes (a shared-memory transpose,
cross-lane reductions, registers) where no GPU is at hand, and a GPU run (``bench_kernels.py --parts
sweep``) decides.

Shapes: Qwen3-Next-80B's 128 x 128 heads, whole tiles, the engine path's specialisations (the non-finite flag
on, 16 ids passed as arguments, unit strides as constants, the rest 16-divisible). Layouts: ``va1`` states
``[H, d_v, d_k]`` (SGLang's), ``va2`` states ``[H, d_k, d_v]`` (FLA / transformers') with the codes in
``[d_v, d_k]`` (the pool's order before 4623ffd), ``va2q`` the same states with the codes in their order (the
pool's since).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.common import write_results  # noqa: E402
from tiered_cache.kernels import quant  # noqa: E402

OPS = ("LDG", "STG", "STS", "LDS", "SHFL", "BAR", "FMNMX", "FFMA", "FMUL", "F2I", "PRMT", "IMAD", "LOP3")
DV = DK = 128


def _nvdisasm() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def programs_per_sm(regs: int, warps: int) -> int:
    """Programs an sm_90 SM holds by registers alone: 65,536 a SM, given out per warp in units of 256 (a
    thread's count rounded up to 8), at most 64 warps and 32 programs; shared memory and the rest not counted."""
    per_warp = -(-regs // 8) * 8 * 32
    return min(65536 // (per_warp * warps), 64 // warps, 32)


def counts(kernel: Any, ptrs: dict[str, str], const: dict[str, Any], ints: dict[str, int], warps: int) -> dict:
    """SASS opcode counts and shared bytes of ``kernel`` compiled for sm_90: pointer arguments typed by ``ptrs``
    (others ``*i64``), ``const`` the constexprs, ``ints`` integer arguments' values where known (1: a constant,
    as Triton specialises it; others 16-divisible i64; unnamed: i64)."""
    sig: dict[str, str] = {}
    consts: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, name in enumerate(kernel.arg_names):
        if name.endswith("_ptr"):
            sig[name] = ptrs.get(name, "*i64")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in const or ints.get(name) == 1:
            sig[name] = "constexpr"
            consts[(i,)] = const.get(name, 1)
        else:
            sig[name] = "i32" if name in ("N", "H", "D_V", "D_K") else "i64"
            if name in ints:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_nvdisasm(), "-c", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_cuobjdump(), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0].rstrip(";")
           for line in sass.splitlines() if re.match(r"^\s*/\*[0-9a-f]{4}\*/", line)]
    by = collections.Counter(op.split(".")[0] for op in ops if op != "NOP")
    return {"instructions": sum(by.values()), "shared_bytes": compiled.metadata.shared, "registers": regs,
            "programs_per_sm": programs_per_sm(regs, warps), "ops": dict(by)}


def _strides(layout: str) -> dict[str, int]:
    """Element strides of the value and channel axes: the state (``s_``/``d_``) and the codes (``q_``)."""
    state = (DK, 1) if layout == "va1" else (1, DK)  # (value, channel)
    codes = (1, DV) if layout == "va2q" else (DK, 1)
    return {"v": state[0], "k": state[1], "qv": codes[0], "qk": codes[1]}


def store(layout: str, dtype: str, tile: int, warps: int) -> dict:
    st = _strides(layout)
    const = dict(BLOCK_V=DV, BLOCK_K=min(DK, tile // DV), KIND=1 if dtype == "bf16" else 0, MIN_SCALE=0.0,
                 FMA_DIV=True, EVEN=True, FLAG=True, NA=16)
    ints = dict(s_l=16, s_r=16, s_h=16, s_v=st["v"], s_k=st["k"], q_l=16, q_s=16, q_h=16, q_v=st["qv"],
                q_k=st["qk"], c_l=16, c_s=16, c_h=16, c_k=1)
    kernel = quant._quantize_store_kernel
    ptrs = {"src_ptr": "*" + dtype, "q_ptr": "*i8", "s_ptr": "*" + dtype, "fin_ptr": "*u8"}
    return counts(kernel, ptrs, const, ints, warps)


def load(layout: str, dtype: str, tile: int, warps: int) -> dict:
    st = _strides(layout)
    const = dict(BLOCK_V=DV, BLOCK_K=min(DK, tile // DV), KIND=1 if dtype == "bf16" else 0, EVEN=True, NA=16)
    ints = dict(q_l=16, q_s=16, q_h=16, q_v=st["qv"], q_k=st["qk"], c_l=16, c_s=16, c_h=16, c_k=1, d_l=16,
                d_r=16, d_h=16, d_v=st["v"], d_k=st["k"])
    ptrs = {"q_ptr": "*i8", "s_ptr": "*" + dtype, "dst_ptr": "*" + dtype}
    return counts(quant._dequantize_load_kernel, ptrs, const, ints, warps)


def cases(quick: bool) -> list[tuple[str, Any]]:
    """(name, thunk): the store and load of each layout and dtype at the tiles the kernels use, and (not
    ``quick``) the store's other tiles of the sweep."""
    out: list[tuple[str, Any]] = []
    for dt in ("fp32", "bf16"):
        for lay in ("va1", "va2", "va2q"):
            out.append((f"store_{dt}_{lay}_{quant._STORE_TILE}_w{quant._STORE_WARPS}",
                        lambda lay=lay, dt=dt: store(lay, dt, quant._STORE_TILE, quant._STORE_WARPS)))
            out.append((f"load_{dt}_{lay}_{quant._LOAD_TILE}_w{quant._LOAD_WARPS}",
                        lambda lay=lay, dt=dt: load(lay, dt, quant._LOAD_TILE, quant._LOAD_WARPS)))
    if not quick:
        for tile, warps in ((4096, 2), (2048, 1), (16384, 8)):
            for lay in ("va1", "va2q"):
                out.append((f"store_bf16_{lay}_{tile}_w{warps}",
                            lambda lay=lay, t=tile, w=warps: store(lay, "bf16", t, w)))
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="only the tiles the kernels use")
    args = parser.parse_args(argv)
    rows, metrics = [], {}
    for name, fn in cases(args.quick):
        got = fn()
        rows.append({"kernel": name, "instructions": got["instructions"], "shared_bytes": got["shared_bytes"],
                     "registers": got["registers"], "programs_per_sm": got["programs_per_sm"],
                     **{op: got["ops"].get(op, 0) for op in OPS}})
        metrics[f"{name}_instructions"] = got["instructions"]
        print(f"{name:36} {got['instructions']:5} instructions, shared {got['shared_bytes']:6} B, "
              f"{got['registers']} registers ({got['programs_per_sm']} programs a SM)  "
              + " ".join(f"{op}={got['ops'].get(op, 0)}" for op in OPS), flush=True)
    info = {"target": "sm_90 (H100 / H200), compiled on the CPU: no GPU ran", "triton": triton.__version__,
            "counts": "SASS instructions a thread of one program, static (NOP excluded); no speed",
            "registers": "a thread's, from cuobjdump -res-usage; programs_per_sm: by registers alone"}
    path = write_results("sass", metrics, rows=rows, info=info, out_dir=str(args.out))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
