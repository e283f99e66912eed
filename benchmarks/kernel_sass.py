"""What the GPU class path's Pallas kernels compile to, with no GPU: registers, spills and the
machine code's instruction mix for Hopper (sm_90a), read before spending device time.

    python benchmarks/kernel_sass.py --triton-python /path/to/python [--out FILE]
        (the records go to FILE, else runs/benchmarks/kernel_sass_cpu.json)
    python benchmarks/kernel_sass.py --ttir-only DIR      # the first stage alone

Two stages. This interpreter (JAX) lowers each form to Triton's IR (Pallas' ``debug`` print of
the module it hands to Triton; the reference scenario, 4,096 plans). An interpreter that has
the ``triton`` package (``--triton-python``; e.g. ``python3 -m venv /tmp/tri && /tmp/tri/bin/pip
install triton``, ~300 MB, not a dependency of this project) compiles each for sm_90a, runs
the ``ptxas -v`` and ``cuobjdump -sass`` that its package carries, and prints one JSON line
per form: ``registers``, ``spill_bytes`` (stores), ``stack_bytes``, ``sass_instructions``,
``loop_instructions`` (the body of the loop over row tiles, where there is one),
``opcodes`` (the loop's, or the kernel's, ten most frequent), and
``warp_instructions_per_plan`` (the instructions a warp issues, the loop's body once per row
tile, times the warps, over the plans of a program: per plan and tenant, branches not
followed).

Triton's version there need not be the one inside the GPU's JAX (XLA compiles the same IR
with its own): the counts are a lead, not a measurement (docs/performance.md, thirtieth
round).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# (name, kind, keyword arguments): the library's kernels at their defaults and in a loop,
# the candidate stacked form (benchmarks/class_kernels.py)
FORMS = (
    ("count_ids", "count", {}),
    ("count_ids_loop", "count", {"loop_tiles": True}),
    ("class_sums", "sums", {}),
    ("class_sums_loop", "sums", {"loop_tiles": True}),
    ("stacked_count_ids", "stacked", {}),
    ("stacked_count_ids_8_warps", "stacked", {"num_warps": 8}),
)


def write_ttir(folder: str, batch: int = 4096) -> list[dict]:
    """Stage 1 (JAX): each form's Triton IR as ``{folder}/{name}.ttir``; returns what stage 2
    needs of each (name, warps, plans per program, row tiles)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export
    from jax.experimental import pallas as pl

    sys.path.insert(0, HERE)
    import class_kernels as ck

    import libratio_jax as lj
    from libratio_jax.physics import gpu_kernels as G

    grid = np.asarray(lj.reference_scenario().row_classes)
    ids = jax.ShapeDtypeStruct((batch, 4, 399), jnp.uint8)
    sums = [jax.ShapeDtypeStruct((4, batch, 16), jnp.float32),
            jax.ShapeDtypeStruct((4, 12, 6, 16), jnp.float32),
            jax.ShapeDtypeStruct((4, 21, 16, 12), jnp.float32)]
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    original = pl.pallas_call
    out = []
    try:
        pl.pallas_call = lambda *a, **k: original(*a, **dict(k, debug=True))
        for name, kind, kw in FORMS:
            if kind == "count":
                fn, shapes = (lambda x, kw=kw: G.count_ids(grid, x, **kw)), [ids]
            elif kind == "sums":
                fn, shapes = (lambda x, *a, kw=kw: G.class_sums(grid, x, *a, **kw)), [ids, *sums]
            else:
                fn, shapes = (lambda x, kw=kw: ck.stacked_count_ids(grid, x, raw=True, **kw)), [ids]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(*shapes)
            with open(os.path.join(folder, f"{name}.ttir"), "w") as f:
                f.write(_module_text(printed.getvalue()))
            bp = kw.get("plans_per_program", 16 if kind == "stacked" else G.PLANS_PER_PROGRAM)
            lt = kw.get("rows_per_tile", 64 if kind == "stacked" else G.ROWS_PER_TILE)
            out.append(dict(form=name, num_warps=kw.get("num_warps", G.NUM_WARPS),
                            plans_per_program=bp, row_tiles=-(-399 // lt)))
    finally:
        pl.pallas_call = original
    return out


def _module_text(printed: str) -> str:
    """The Triton module of Pallas' debug print, its location annotations removed (Triton's
    parser reads it then)."""
    lines = printed.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("module @"))
    depth, module = 0, []
    for line in lines[start:]:
        module.append(line)
        depth += line.count("{") - line.count("}")
        if depth == 0 and len(module) > 1:
            break
    text = "\n".join(module)
    text = re.sub(r' \[unknown\]', "", text)
    text = re.sub(r' "[^"]*"\(#loc[0-9]+\)', "", text)
    text = re.sub(r" \[[^\]\n]*\]$", "", text, flags=re.M)
    return "\n".join(line for line in text.split("\n") if not line.startswith("#loc"))


def compile_and_read(folder: str, forms: list[dict]) -> list[dict]:
    """Stage 2 (an interpreter with ``triton``): compile, ``ptxas -v``, disassemble, count."""
    import warnings

    warnings.filterwarnings("ignore")
    import triton
    from triton.backends.compiler import GPUTarget

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(p for p in (os.path.join(tools, "ptxas-blackwell"), os.path.join(tools, "ptxas"))
                 if os.path.exists(p))
    records = []
    for form in forms:
        base = os.path.join(folder, form["form"])
        kernel = triton.compile(base + ".ttir", target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=form["num_warps"], num_stages=1))
        with open(base + ".ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", base + ".ptx", "-o",
                                 base + ".cubin"], capture_output=True, text=True,
                                check=True).stderr
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", base + ".cubin"],
                              capture_output=True, text=True, check=True).stdout
        ins = _instructions(sass)
        loop = _loop(ins)
        body = ins[loop[0]:loop[1] + 1] if loop else ins
        # each warp runs the kernel once, the loop's body once per row tile
        per_warp = len(ins) + (len(body) * (form["row_tiles"] - 1) if loop else 0)

        def number(pattern, text=report):
            m = re.search(pattern, text)
            return int(m.group(1)) if m else 0

        records.append(dict(
            benchmark="kernel_sass", form=form["form"], target="sm_90a",
            triton=triton.__version__, num_warps=form["num_warps"],
            plans_per_program=form["plans_per_program"],
            registers=number(r"Used (\d+) registers"),
            spill_bytes=number(r"(\d+) bytes spill stores"),
            stack_bytes=number(r"(\d+) bytes stack frame"),
            sass_instructions=len(ins), loop_instructions=len(body) if loop else None,
            opcodes=dict(collections.Counter(op.split(".")[0] for _, op, _ in body)
                         .most_common(10)),
            warp_instructions_per_plan=round(per_warp * form["num_warps"]
                                             / form["plans_per_program"], 1)))
    return records


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    out = []
    for line in sass.split("\n"):
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);",
                     line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def _loop(ins) -> tuple[int, int] | None:
    """The largest backward branch's ``(first, last)`` instruction: the loop over row tiles."""
    where = {address: i for i, (address, _, _) in enumerate(ins)}
    best = None
    for i, (address, op, rest) in enumerate(ins):
        m = re.match(r"\s*(0x[0-9a-f]+)", rest) if op == "BRA" else None
        j = where.get(int(m.group(1), 16)) if m else None
        if j is not None and int(m.group(1), 16) < address and (
                best is None or i - j > best[1] - best[0]):
            best = (j, i)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton-python", help="an interpreter that has the triton package")
    ap.add_argument("--ttir-only", metavar="DIR", help="write the Triton IR into DIR and stop")
    ap.add_argument("--compile", metavar="DIR", help=argparse.SUPPRESS)  # stage 2's entry
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.compile:
        with open(os.path.join(args.compile, "forms.json")) as f:
            for rec in compile_and_read(args.compile, json.load(f)):
                print(json.dumps(rec), flush=True)
        return
    if not (args.ttir_only or args.triton_python):
        ap.error("give --triton-python (or --ttir-only DIR)")
    folder = args.ttir_only or tempfile.mkdtemp(prefix="lj-sass-")
    os.makedirs(folder, exist_ok=True)
    forms = write_ttir(folder)
    with open(os.path.join(folder, "forms.json"), "w") as f:
        json.dump(forms, f)
    if args.ttir_only:
        print(f"wrote {len(forms)} forms' Triton IR into {folder}", flush=True)
        return
    done = subprocess.run([args.triton_python, os.path.abspath(__file__), "--compile", folder],
                          capture_output=True, text=True, check=True)
    shutil.rmtree(folder, ignore_errors=True)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for rec in records:
        print(json.dumps(rec), flush=True)
    sys.path.insert(0, HERE)
    from common import save_records

    save_records("kernel_sass", records, args.out)


if __name__ == "__main__":
    main()
