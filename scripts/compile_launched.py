"""Compile, for sm_90a on a machine without a GPU, exactly the builds the Python launchers would launch.

    python scripts/compile_launched.py CASE [--shape B,S,H,Hkv,D] [--causal] [--split | --no-split] [--dump DIR]
        [--compare-checked] [--check] [--all] [--no-compile] [--json PATH]

CASE: ``dkdv`` (the Gluon dK/dV kernel), ``dq`` (the Gluon dQ kernel), ``fwd-gluon``, ``fwd-tl``, ``quant-forward``
(``forward_operands_triton``'s launches, without and with ``keep_kv``), ``quant-bench`` (every row of
``mxattn.bench.quantize_bench`` on a (B, S, H, D) bf16 input; tags name the rows).  Default shape B2 S8192 H16 Hkv16
d128 (the quantize bench's is 8,8192,16,16,128).
Needs triton 3.6 for the builds (its Gluon and its bundled ptxas 12.8, the GPU machine's versions); the capture
and ``--no-compile`` also run with other versions (the ``tl`` cases; the specialization is then that version's).

Why: the ``compile_check_*.py`` scripts write signatures by hand, every int argument a plain ``i32``.  Triton's JIT
specializes at launch: an int equal to 1 becomes a constant, an int divisible by 16 and a pointer whose address
is 16-byte aligned get ``tt.divisibility = 16``, and None becomes a constexpr; the code changes with that (vector
widths, folded address arithmetic).  This script builds what a launch builds.

How:

1. Capture.  The case runs the real host code on CPU tensors of the shape asked for (``torch.empty``: nothing is
   read), as the library runs on an H200: ``_bwd_impl`` / ``_hopper_forward_keeping_kv`` of ``mxattn.interface``
   (the training path; ``dkdv`` / ``dq`` follow ``_bwd_impl``'s CUDA branch line by line, since that function
   checks ``q.device.type``), ``attn_bwd.attn_bwd_hopper`` with its default (split) Gluon path,
   ``quantize.forward_operands_triton``.  Every launch reaches ``JITFunction.run`` (``launch.triton_dispatch()``
   sends the project's fast launcher and its bound plans through ``jit_fn[grid](...)``); ``run`` is replaced
   for the duration by a recorder that keeps the kernel, grid, positional arguments and keywords (constexprs and
   options: num_warps, maxnreg, ...) and launches nothing.  What the host code decides from the device is
   answered as on an H200 (``as_on_h200``): the quantize wrappers take CPU tensors (``_check_device``) and pick
   the CUDA rounding (``_soft``), the backward picks its kernels for device ``cuda:0`` with capability (9, 0)
   (``attn_bwd.backward_kernel``).  Nothing in ``mxattn`` is changed.  CPU tensors stand in for the device's: a
   fresh CPU allocation is 64-byte aligned, a CUDA one 512-byte aligned, and views keep the same offsets, so
   every pointer has the 16-byte alignment it has on the GPU.

2. Specialize and compile with Triton's own code.  A stand-in for Triton's active driver answers what ``run``
   asks the driver (device 0, stream 0, target ``GPUTarget("cuda", 90, 32)``, as an H200 answers), then each
   captured launch goes through the unmodified ``JITFunction.run(*args, grid=grid, warmup=True, **kwargs)``:
   Triton's binder specializes every argument (``native_specialize_impl``: ints == 1, % 16, i32 / i64 by range,
   pointer alignment, ``do_not_specialize``, Triton and Gluon ``TensorDescriptor`` types with their block shape
   and layout, None, constexpr), parses the options and compiles (``warmup=True`` compiles without launching).
   The specialization printed is the ``ASTSource`` Triton compiled (``CompiledKernel.src``: signature, constants,
   attrs); ``--no-compile`` asks for it through ``knobs.runtime.jit_cache_hook`` (called with the specialization
   before a compile; returning True skips it).  So nothing of the JIT's rules is re-implemented here, and any
   argument kind is specialized exactly as the JIT does.

What may still differ from the GPU machine (the specialization itself cannot: it is Triton's):
- environment knobs that change a build (``TRITON_*``, ``MXATTN_*``): the same variables are read here, so set
  them as there.  ``MXATTN_BWD_KERNEL=gluon`` is refused (``attn_bwd_hopper`` then tests the device type); the
  default ("auto") takes the Gluon kernels here as on the H200.
- the operands' provenance: the cases make them as the training path does (``forward_operands_triton(keep_kv=
  True)`` for K / V, Q and dO through ``row_scaled_triton_both_pair``); a caller whose operands have other
  strides, dtypes or alignment launches other builds.  ``dkdv`` / ``dq`` copy ``_bwd_impl``'s few lines (a change
  there must be made here too); the inference forward's single passes make the same layouts.
- a device decision of the host code that ``as_on_h200`` does not answer would be taken for a CPU tensor (those
  known: ``_soft``, ``_check_device``, ``backward_kernel``; the plan caches' ``is_cuda`` keys do not change a
  build).
- what Triton checks only when it loads the cubin on a device (shared memory, threads) is not checked here.

Output per selected launch: the kernel, grid and options; the specialization (ints that became the constant 1,
ints and pointers marked divisible by 16, plain ints, pointers not 16-byte aligned, descriptors); registers
(launch budget and highest register in the SASS), stack, spill bytes (``ptxas -v``), local memory, shared memory;
SASS instruction count and the global / shared / local memory, barrier and shuffle instructions by opcode and width;
for kernels with a wgmma consumer loop, each loop's instructions and its common step's path
(``compile_check_gluon.steady_loops`` / ``step_path``).  ``--compare-checked`` (``dkdv``, ``dq``, ``fwd-gluon``,
``quant-forward``) builds the hand-made variant too (``compile_variant`` of ``compile_check_bwd_dkdv_gluon``,
``compile_check_bwd_dq_gluon``, ``compile_check_gluon``; ``compile_check_quantize.operands_variant`` with the
``--ints`` that script takes for the shape: ``all`` when S % 16 == 0, else ``lengths``) and prints both side by
side, with the arguments whose specialization differs.  ``--all`` reports every captured launch of the case
(quantize and δ launches included).
``--check`` applies the pass / fail rules of the hand-made check script (``compile_check_bwd_dkdv_gluon.check``,
``compile_check_gluon.check``, ``partition_report``) to the launched build; exit status 1 when one fails.
``--dump DIR`` writes each build's TTGIR, PTX and SASS.  ``--json PATH`` writes the launches and their
specializations as JSON (for tests).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, _HERE)
# the launched build is the compiled one: under the interpreter triton.jit makes no JITFunction to capture
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    print("compile_launched: TRITON_INTERPRET=1 ignored (the JIT's builds are the subject here)", file=sys.stderr)
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # what the H200's driver reports (capability 9.0, 32 threads per warp)
CASES = ("dkdv", "dq", "fwd-gluon", "fwd-gluon-fp32", "fwd-tl", "quant-forward", "quant-bench")
# the kernels each case reports (function names; ``--all``: every captured launch)
CASE_KERNELS = {"dkdv": ("_attn_bwd_dkdv_ws_kernel", "_attn_bwd_dkdv_ws_persistent_kernel"), "dq": ("_attn_bwd_dq_ws_kernel",),
                "fwd-gluon": ("_attn_fwd_ws_kernel", "_attn_fwd_ws_persistent_kernel"),
                "fwd-gluon-fp32": ("_attn_fwd_ws_kernel", "_attn_fwd_ws_persistent_kernel"), "fwd-tl": ("_attn_fwd_kernel",),
                "quant-forward": ("_operands_kernel",),
                "quant-bench": ("_quantize_kernel", "_hdim_kernel", "_seq_exponent_kernel", "_rescale_mx_kernel", "_dequantize_kernel",
                                "_hdim_rescale_kernel", "_hdim_dequant_kernel", "_seq_dequant_kernel",
                                "_seq_rescale_kernel", "_mx_channel_exponent_kernel", "_seq_rescale_rows_kernel",
                                "_operands_kernel")}
MEM_OPS = ("LDG", "STG", "LDS", "STS", "LDL", "STL", "BAR", "SHFL")


# ------------------------------------------------------------------------------------------------- capture
@dataclasses.dataclass
class Launch:
    """One captured ``jit_fn[grid](*args, **kwargs)``; ``tag`` names its place in the case (e.g. "keep_kv")."""

    kernel: JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    tag: str = ""

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@contextlib.contextmanager
def _patched(patches):
    """Set ``(obj, attr, value)`` for the block, then restore each attribute."""
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    try:
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


def as_on_h200():
    """The host code's device decisions answered as on an H200 (CUDA device 0, capability (9, 0)) for CPU tensors:
    the quantize wrappers accept them (``_check_device``) and pick the CUDA rounding mode (``_soft``), and
    ``attn_bwd.backward_kernel`` decides for ``cuda:0`` with the Gluon kernels available where this Triton is a
    verified one (``kernels.gluon_verified``), as ``_gluon_runs_on`` finds on the H200."""
    from mxattn.kernels import attn_bwd, gluon_verified, quantize

    cuda0 = torch.device("cuda", 0)
    soft, choose = quantize._soft, attn_bwd.backward_kernel
    return _patched([
        (quantize, "_check_device", lambda t, name: None),
        (quantize, "_soft", lambda device: soft(cuda0)),
        (attn_bwd, "_gluon_runs_on", lambda device_index: gluon_verified()),
        (attn_bwd, "backward_kernel", lambda device=None: choose(cuda0)),
    ])


@contextlib.contextmanager
def capture():
    """Within the block, launches are recorded (``Launch``) in the list it yields and nothing runs: every
    ``JITFunction.run`` (what ``jit_fn[grid](...)`` calls), under ``launch.triton_dispatch()`` so that the fast
    launcher and the bound plans take that path, and ``as_on_h200``.  A ``warmup`` call (no launch) raises."""
    from mxattn.kernels import launch as launch_mod

    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        if warmup:
            raise RuntimeError(f"compile_launched: unexpected warmup of {self.fn.__name__} during the capture")
        launches.append(Launch(self, grid if callable(grid) else tuple(grid), args, dict(kwargs)))

    with _patched([(JITFunction, "run", record)]), launch_mod.triton_dispatch(), as_on_h200():
        yield launches


def _tag(launches: list[Launch], start: int, tag: str) -> None:
    for lc in launches[start:]:
        lc.tag = lc.tag or tag


def _inputs(shape, dtype=torch.bfloat16):
    B, S, H, Hkv, D = shape
    return (torch.empty(B, S, H, D, dtype=dtype), torch.empty(B, S, Hkv, D, dtype=dtype),
            torch.empty(B, S, Hkv, D, dtype=dtype))


def _forward(q, k, v, causal: bool, backend: str):
    """The training forward (``interface._hopper_forward_keeping_kv``): out, lse and the backward's K/V operands."""
    from mxattn import interface

    scale = 1.0 / math.sqrt(q.shape[3])
    return interface._hopper_forward_keeping_kv(q, k, v, causal, scale, "rceil", backend)


def _backward(q, dout, out, lse, kv, causal: bool):
    """``interface._bwd_impl``'s CUDA branch with the forward's kept K/V operands (that function tests
    ``q.device.type``, so its lines are followed here: rceil, dO in q's dtype)."""
    from mxattn.kernels.attn_bwd import DO_EXP_GROUP, Q_EXP_GROUP, attn_bwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton_both, row_scaled_triton_both_pair

    dout = dout.contiguous()
    doh = dos = None
    if DO_EXP_GROUP == Q_EXP_GROUP:
        (qr, q_seq), (doh, dos) = row_scaled_triton_both_pair(q, dout, "rceil", k_group=Q_EXP_GROUP)
    else:
        qr, q_seq = row_scaled_triton_both(q, "rceil", k_group=Q_EXP_GROUP)
    kr, k_seq, v_hdim = kv
    return attn_bwd_hopper(qr, kr, v_hdim, q_seq, k_seq, out, dout, lse, causal=causal,
                           softmax_scale=1.0 / math.sqrt(q.shape[3]), deterministic=False, grad_dtype=q.dtype,
                           dout_hdim=doh, dout_seq=dos)


def capture_case(case: str, shape, causal: bool) -> list[Launch]:
    """Every launch of the host path behind ``case`` at ``shape`` (B, S, H, Hkv, D), in order, tagged by phase."""
    from mxattn.interface import K_EXP_GROUP
    from mxattn.kernels.quantize import forward_operands_triton

    q, k, v = _inputs(shape)
    with capture() as launches:
        if case == "quant-forward":
            for keep in (False, True):
                n = len(launches)
                forward_operands_triton(q, k, v, "rceil", k_group=K_EXP_GROUP, keep_kv=keep)
                _tag(launches, n, "keep_kv" if keep else "no keep_kv")
        elif case == "quant-bench":
            from mxattn.bench.quantize_bench import KERNELS, _make_call

            for kernel in KERNELS:
                n = len(launches)
                fn = _make_call(kernel, q)
                _tag(launches, n, kernel + " (setup)")
                n = len(launches)
                fn()
                _tag(launches, n, kernel)
            launches[:] = [lc for lc in launches if not lc.tag.endswith("(setup)")]
        elif case in ("fwd-gluon", "fwd-tl"):
            _forward(q, k, v, causal, "gluon" if case == "fwd-gluon" else "hopper")
            _tag(launches, 0, "forward")
        elif case == "fwd-gluon-fp32":  # the context-parallel ring's call (mxattn.distributed): fp32 out
            from mxattn.kernels.attn_fwd_gluon import attn_fwd_gluon

            qr, kr, vr, _ = forward_operands_triton(q, k, v, "rceil", k_group=K_EXP_GROUP)
            n = len(launches)
            attn_fwd_gluon(qr, kr, vr, causal=causal, out_dtype=torch.float32)
            _tag(launches, n, "forward (fp32 out)")
            launches[:] = launches[n:]
        elif case in ("dkdv", "dq"):
            out, lse, kv = _forward(q, k, v, causal, "hopper")
            _tag(launches, 0, "forward")
            n = len(launches)
            _backward(q, torch.empty_like(q), out, lse, kv, causal)
            _tag(launches, n, "backward")
        else:
            raise ValueError(f"unknown case {case!r} (one of {', '.join(CASES)})")
    return launches


# ------------------------------------------------------------------------------------------------- Triton's JIT
class _Sm90Driver:
    """What ``JITFunction.run`` asks the active driver (device, stream, target), answered as an H200 would."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET


@contextlib.contextmanager
def sm90_driver():
    from triton.runtime.driver import driver

    saved = driver._active  # (None until a driver was asked for: the default one would need CUDA)
    driver.set_active(_Sm90Driver())
    try:
        yield
    finally:
        driver.set_active(saved)


def compile_launch(lc: Launch):
    """The ``CompiledKernel`` Triton's ``run`` builds for this launch (``warmup=True``: compiled, not launched)."""
    with sm90_driver():
        return lc.kernel.run(*lc.args, grid=lc.grid, warmup=True, **dict(lc.kwargs))


@dataclasses.dataclass
class Spec:
    """The specialization of a build: ``signature`` (name -> type), ``constants`` (path -> value), ``attrs``
    (path -> [[attr, value]]), as in Triton's ``ASTSource``."""

    signature: dict
    constants: dict
    attrs: dict

    @classmethod
    def of(cls, compiled) -> "Spec":
        src = compiled.src
        return cls(dict(src.signature), dict(src.constants), dict(src.attrs))


def specialize_launch(lc: Launch) -> Spec:
    """The specialization Triton's ``run`` computes for this launch, without compiling: ``jit_cache_hook`` gets it
    before the compile and returns True (skip).  A kernel already compiled in this process: its ``src``."""
    from triton import knobs

    seen = []

    def hook(*, compile, **_):
        seen.append(Spec(dict(compile["signature"]), dict(compile["constants"]), dict(compile["configs"][0])))
        return True

    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        with sm90_driver():
            k = lc.kernel.run(*lc.args, grid=lc.grid, warmup=True, **dict(lc.kwargs))
    finally:
        knobs.runtime.jit_cache_hook = saved
    return seen[0] if seen else Spec.of(k)


def spec_groups(fn, spec: Spec) -> dict:
    """The non-constexpr parameters of ``fn`` by what the specialization made of them."""
    groups = collections.OrderedDict((g, []) for g in (
        "int -> constant 1", "int, divisible by 16", "int", "pointer, 16-byte aligned", "pointer, not aligned",
        "None -> constexpr", "other constant", "descriptor", "float", "other"))
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            continue
        ty = spec.signature.get(p.name)
        div = any(a == ["tt.divisibility", 16] or tuple(a) == ("tt.divisibility", 16)
                  for a in spec.attrs.get((i,), []))
        if ty == "constexpr":
            val = spec.constants.get((i,))
            val = getattr(val, "value", val)
            g = "int -> constant 1" if val == 1 and not isinstance(val, bool) else (
                "None -> constexpr" if val is None else "other constant")
            groups[g].append(p.name if g != "other constant" else f"{p.name}={val!r}")
        elif ty.startswith("*"):
            groups["pointer, 16-byte aligned" if div else "pointer, not aligned"].append(p.name)
        elif re.fullmatch(r"[iu]\d+", ty):
            groups["int, divisible by 16" if div else "int"].append(p.name if ty == "i32" else f"{p.name}:{ty}")
        elif ty.startswith("tensordesc"):
            groups["descriptor"].append(f"{p.name}: {_short_desc(ty)}")
        elif ty.startswith("fp"):
            groups["float"].append(p.name)
        else:
            groups["other"].append(f"{p.name}: {ty}")
    return {g: v for g, v in groups.items() if v}


def _short_desc(ty: str) -> str:
    mm = re.match(r"tensordesc<([^\[]+)(\[[^\]]*\])", ty)
    sw = re.search(r"swizzle_byte_width=(\d+)", ty)
    return f"{mm.group(1)}{mm.group(2)}" + (f" swizzle {sw.group(1)}" if sw else "") if mm else ty


def spec_diff(fn, a: Spec, b: Spec) -> dict:
    """Parameters specialized differently in ``a`` and ``b``: "(state in a) | (state in b)" -> names, a state being
    the type with " div16" for divisibility, or "constexpr VALUE"."""
    def state(spec, i, name):
        ty = spec.signature.get(name)
        if ty == "constexpr":
            v = spec.constants.get((i,))
            return f"constexpr {getattr(v, 'value', v)!r}"
        div = any(list(x) == ["tt.divisibility", 16] for x in spec.attrs.get((i,), []))
        return f"{ty}{' div16' if div else ''}"

    out = collections.OrderedDict()
    for i, p in enumerate(fn.params):
        x, y = state(a, i, p.name), state(b, i, p.name)
        if x != y:
            out.setdefault(f"{x} | {y}", []).append(p.name)
    return out


# ------------------------------------------------------------------------------------------------- metrics
def metrics(k) -> dict:
    """Resource use and instruction counts of a compiled kernel (helpers of compile_check_gluon.py)."""
    from compile_check_gluon import _opcode, _ptxas_verbose, _resource_usage, _sass_instrs, step_path, steady_loops

    usage = _resource_usage(k.asm["cubin"])
    sass = usage["sass"]
    ins = _sass_instrs(sass)
    ptxas = _ptxas_verbose(k.asm["ptx"])
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    m = collections.OrderedDict()
    m["registers (launch)"] = usage["regs"]
    m["highest register in SASS"] = max((int(r) for _, t in ins for r in re.findall(r"\bR(\d+)\b", t)), default=-1)
    m["stack bytes"] = usage["stack"]
    m["spill stores + loads (ptxas -v, bytes)"] = f"{sum(int(a) for a, _ in spills)} + {sum(int(b) for _, b in spills)}"
    m["local bytes"] = usage["local"]
    m["shared bytes"] = k.metadata.shared
    m["SASS instructions"] = len(ins)
    ops = collections.Counter()
    for _, t in ins:
        if _opcode(t) in MEM_OPS:
            ops[re.sub(r"^@!?U?P[T0-9]+\s+", "", t).split()[0]] += 1
    for op in sorted(ops, key=lambda o: (MEM_OPS.index(_opcode(o)), o)):
        m[op] = ops[op]
    for j, lp in enumerate(steady_loops(sass)):
        st = step_path(sass, lp)
        m[f"loop {j} instructions (both paths)"] = lp["instrs"]
        m[f"loop {j} LDL + STL (both paths)"] = lp["counts"]["LDL"] + lp["counts"]["STL"]
        m[f"loop {j} common step: instructions"] = st["instrs"]
        for key in ("LDG", "LDS", "STS", "SHFL", "BAR.SYNC", "DEPBAR"):
            m[f"loop {j} common step: {key}"] = st[key]
    m["_asm"] = {"ttgir": k.asm.get("ttgir", ""), "ptx": k.asm["ptx"], "sass": sass, "ptxas.txt": ptxas}
    return m


def _options(lc: Launch) -> dict:
    names = set(lc.kernel.arg_names)
    return {key: v for key, v in lc.kwargs.items() if key not in names}


def _constexprs(lc: Launch) -> dict:
    names = {p.name for p in lc.kernel.params if p.is_constexpr}
    return {key: v for key, v in lc.kwargs.items() if key in names}


def _print_spec(fn, spec: Spec, indent: str = "   ") -> None:
    for g, names in spec_groups(fn, spec).items():
        print(f"{indent}{g} ({len(names)}): {', '.join(names)}")


def _print_metrics_side(columns: dict) -> None:
    """Print metrics dicts side by side (``columns``: label -> ``metrics``), the memory / barrier / shuffle opcodes
    of all columns together in one order."""
    keys = []
    for m in columns.values():
        keys += [key for key in m if key != "_asm" and key not in keys]
    ops = sorted((key for key in keys if key.split(".")[0] in MEM_OPS),
                 key=lambda o: (MEM_OPS.index(o.split(".")[0]), o))
    rest = [key for key in keys if key not in ops]
    at = rest.index("SASS instructions") + 1
    keys = rest[:at] + ops + rest[at:]
    w = max(len(key) for key in keys)
    print("   " + " " * w + "".join(f"  {label:>14}" for label in columns))
    for key in keys:
        print("   " + key.ljust(w) + "".join(f"  {m.get(key, '-')!s:>14}" for m in columns.values()))


def _dump(dump: str | None, stem: str, m: dict) -> None:
    if not dump:
        return
    os.makedirs(dump, exist_ok=True)
    for ext, text in m["_asm"].items():
        if text:
            with open(os.path.join(dump, f"{stem}.{ext}"), "w") as f:
                f.write(text)


# ------------------------------------------------------------------------------------------------- checked builds
def checked_build(case: str, lc: Launch, shape):
    """The hand-made build of ``compile_check_*`` for this launch (None where there is none)."""
    D = shape[4]
    c = _constexprs(lc)
    if case == "dkdv":
        import compile_check_bwd_dkdv_gluon as cc

        return cc.compile_variant(D, c["CAUSAL"], c["STAGES"], split=c["SPLIT"], defer_dk=c["DEFER_DK"],
                                  ds_exp="key" if c["DS_KEY_EXP"] else "tile")
    if case == "dq":
        import compile_check_bwd_dq_gluon as cc

        return cc.compile_variant(D, c["CAUSAL"], c["STAGES"], split=c["SPLIT"])
    if case in ("fwd-gluon", "fwd-gluon-fp32"):
        import compile_check_gluon as cc

        return cc.compile_variant(D, c["CAUSAL"], c["PINGPONG"], c["BLOCK_N"], c["STAGES"], k_perm=c["K_PERM"])
    if case == "quant-forward":
        import compile_check_quantize as cc

        jobs = (c["A"], c["B"], c["E"], c["F"])
        launch = {(True, True, True, False): "first", (True, False, False, False): "second",
                  (True, False, True, True): "first_keep", (True, True, False, False): "second_keep"}.get(jobs)
        if launch is None:
            return None
        # the specialization compile_check_quantize takes for this shape: every int divisible by 16 at a
        # power-of-two-like S, the lengths and tile counts not at another S (its --ints all / lengths)
        cc.INTS = "all" if shape[1] % 16 == 0 else "lengths"
        return cc.operands_variant(D, launch)
    return None


def check_launched(case: str, lc: Launch, k, name: str, dump: str | None) -> bool | None:
    """The pass / fail rules of the hand-made check script on the launched build ``k`` (its report printed);
    None where the case has no such rules."""
    c = _constexprs(lc)
    if case == "dkdv":
        import compile_check_bwd_dkdv_gluon as cc
        from compile_check_bwd_dq_gluon import partition_report

        return (cc.check(k, name, dump, split=c["SPLIT"], key_exp=c["DS_KEY_EXP"])
                & partition_report(k, 128 if c["SPLIT"] else 256))
    if case == "dq":
        from compile_check_bwd_dq_gluon import check, partition_report

        return check(k, name, dump) & partition_report(k, 128 if c["SPLIT"] else 256)
    if case in ("fwd-gluon", "fwd-gluon-fp32"):
        from compile_check_gluon import check

        return check(k, name, dump)
    return None


# ------------------------------------------------------------------------------------------------- main
def _describe_arg(v):
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype), "aligned16": v.data_ptr() % 16 == 0, "shape": list(v.shape),
                "stride": list(v.stride())}
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return type(v).__name__


def launch_record(lc: Launch, spec: Spec | None) -> dict:
    names = lc.kernel.arg_names
    rec = {"kernel": lc.name, "tag": lc.tag, "grid": list(lc.grid) if not callable(lc.grid) else "callable",
           "args": {n: _describe_arg(a) for n, a in zip(names, lc.args)},
           "kwargs": {key: _describe_arg(v) for key, v in lc.kwargs.items()}}
    if spec is not None:
        rec["specialization"] = spec_groups(lc.kernel, spec)
    return rec


def _parse_shape(text: str) -> tuple:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 5 or min(parts) < 1:
        raise argparse.ArgumentTypeError("--shape takes B,S,H,Hkv,D (positive ints)")
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=CASES)
    ap.add_argument("--shape", type=_parse_shape, default=(2, 8192, 16, 16, 128), help="B,S,H,Hkv,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=None,
                    help="the Gluon backward's split variants (default: the library's, MXATTN_BWD_GLUON_SPLIT)")
    ap.add_argument("--dump", help="write TTGIR / PTX / SASS of each build here")
    ap.add_argument("--compare-checked", action="store_true",
                    help="also build the hand-made variant of compile_check_* and print both")
    ap.add_argument("--check", action="store_true",
                    help="apply the hand-made check script's pass / fail rules to the launched build (exit status 1 "
                         "when one fails; dkdv, dq, fwd-gluon)")
    ap.add_argument("--all", action="store_true", help="every captured launch of the case, not only its kernel")
    ap.add_argument("--no-compile", action="store_true", help="capture and specialize only")
    ap.add_argument("--json", help="write the launches (and specializations) as JSON here")
    args = ap.parse_args(argv)
    if args.split is not None:
        os.environ["MXATTN_BWD_GLUON_SPLIT"] = "1" if args.split else "0"
    if not triton.__version__.startswith("3.6") and not args.no_compile:
        print(f"warning: triton {triton.__version__}; the GPU machine runs triton 3.6 (its builds differ)")
    B, S, H, Hkv, D = args.shape
    label = f"B{B} S{S} H{H}/{Hkv} d{D}{' causal' if args.causal else ''}"
    launches = capture_case(args.case, args.shape, args.causal)
    print(f"{args.case} at {label}: {len(launches)} launches captured: "
          + ", ".join(f"{lc.name} ({lc.tag})" for lc in launches))
    chosen = launches if args.all else [lc for lc in launches if lc.name in CASE_KERNELS[args.case]]
    if not chosen:
        print(f"no launch of {CASE_KERNELS[args.case]} (the host path took another kernel)")
        return 1
    records = []
    failed = False
    for n, lc in enumerate(chosen):
        stem = f"{args.case}-{n}-{lc.name}"
        print(f"\n== {lc.name} [{lc.tag}] grid {lc.grid}; options {_options(lc)}")
        print(f"   constexprs {_constexprs(lc)}")
        if args.no_compile:
            spec = specialize_launch(lc)
            print("   specialization (Triton's JIT):")
            _print_spec(lc.kernel, spec, "     ")
            records.append(launch_record(lc, spec))
            continue
        k = compile_launch(lc)
        spec = Spec.of(k)
        records.append(launch_record(lc, spec))
        print("   specialization (Triton's JIT):")
        _print_spec(lc.kernel, spec, "     ")
        cols = {"launched": metrics(k)}
        _dump(args.dump, stem + "-launched", cols["launched"])
        if args.compare_checked:
            ck = checked_build(args.case, lc, args.shape)
            if ck is None:
                print("   (no hand-made build for this launch)")
            else:
                cols["checked"] = metrics(ck)
                _dump(args.dump, stem + "-checked", cols["checked"])
                same = ck.src.hash() == k.src.hash()
                print(f"   hand-made build: {'the same build' if same else 'a different build'}; "
                      "arguments specialized differently (launched | checked):")
                diff = spec_diff(lc.kernel, spec, Spec.of(ck))
                for states, names in diff.items():
                    print(f"     {states}: {', '.join(names)}")
                if not diff:
                    print("     none")
        _print_metrics_side(cols)
        if args.check:
            ok = check_launched(args.case, lc, k, f"{stem}-launched (rules of the hand-made check)", None)
            failed |= ok is False
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": args.case, "shape": list(args.shape), "causal": args.causal, "launches": records},
                      f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
