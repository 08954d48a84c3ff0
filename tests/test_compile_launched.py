"""scripts/compile_launched.py: the capture of the launchers' launches on CPU tensors (any triton) and the
specialization Triton 3.6's JIT gives them (triton 3.6 only).

Both run the script in a subprocess without TRITON_INTERPRET: conftest sets it on machines without CUDA, under it
``triton.jit`` makes interpreter functions (no ``JITFunction`` to capture), and the script sets it to 0 at import.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import triton_version

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = os.path.join(_ROOT, "scripts", "compile_launched.py")


def _run(args, timeout=600):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=_ROOT, timeout=timeout)
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    return r.stdout


_CAPTURE = """
import json, sys
sys.path.insert(0, {scripts!r})
import compile_launched as cl
from triton.runtime.jit import JITFunction
run = JITFunction.run
launches = cl.capture_case("fwd-tl", (1, 96, 4, 2, 64), False)
assert JITFunction.run is run, "JITFunction.run not restored"
print(json.dumps([cl.launch_record(lc, None) for lc in launches]))
"""


def test_capture_records_the_forward_launches_without_running_them():
    """The training forward's launches at B1 S96 H4 Hkv2 d64 (the tl kernel): the two fused quantize launches and the
    forward kernel, recorded with their arguments as the launcher passes them (unit strides 1, strides multiples
    of 16, the GQA group 2), nothing launched (no driver here: a launch would raise), ``JITFunction.run``
    restored afterwards."""
    out = _run(["-c", _CAPTURE.format(scripts=os.path.join(_ROOT, "scripts"))])
    recs = json.loads(out.strip().splitlines()[-1])
    assert [r["kernel"] for r in recs] == ["_operands_kernel", "_operands_kernel", "_attn_fwd_kernel"]
    assert all(r["tag"] == "forward" for r in recs)
    fwd = recs[2]
    a = fwd["args"]
    assert a["stride_qd"] == 1 and a["stride_od"] == 1  # contiguous q data and out: unit channel strides
    assert a["stride_qh"] == 64 and a["stride_qm"] == 4 * 64  # D and H*D
    assert a["group_size"] == 2 and a["Sq"] == 96 and a["SLOTS"] is None
    assert a["Q"]["tensor"] == "torch.float8_e4m3fn" and a["Q"]["aligned16"]
    assert fwd["grid"] == [2, 4]  # cdiv(96, 64) query blocks, B * Hq
    assert fwd["kwargs"]["HEAD_DIM"] == 64 and "num_warps" in fwd["kwargs"]


def test_specialization_marks_unit_strides_constant_and_16_multiples_divisible(tmp_path):
    """Triton 3.6's JIT on the Gluon dQ launch at B1 S128 H2 Hkv2 d64 (through ``--no-compile``: the JIT's
    specialization, taken by its cache hook before the compile): dq's unit channel stride and the group of 1 become
    constants, its head stride (64) and sequence stride (2 * 64) and S (128) are marked divisible by 16, the
    pointers aligned, SLOTS (None) a constexpr."""
    if not triton_version().startswith("3.6"):
        pytest.skip(f"the specialization is triton 3.6's (installed: {triton_version() or 'none'})")
    path = tmp_path / "dq.json"
    _run([_SCRIPT, "dq", "--shape", "1,128,2,2,64", "--no-compile", "--json", str(path)])
    rec = json.loads(path.read_text())
    (dq,) = [r for r in rec["launches"] if r["kernel"] == "_attn_bwd_dq_ws_kernel"]
    assert dq["args"]["stride_dqd"] == 1 and dq["args"]["stride_dqh"] == 64
    spec = dq["specialization"]
    assert {"stride_dqd", "stride_lm", "group_size"} <= set(spec["int -> constant 1"])
    assert {"stride_dqh", "stride_dqm", "Sq", "Sk"} <= set(spec["int, divisible by 16"])
    assert {"DQ", "LSE", "QE"} <= set(spec["pointer, 16-byte aligned"])
    assert spec["None -> constexpr"] == ["SLOTS"]
    assert {"Hq", "Hkv"} <= set(spec["int"])  # 2: neither 1 nor a multiple of 16


@pytest.mark.slow
def test_compiles_the_launched_gluon_dq_build(tmp_path):
    """The whole path with triton 3.6: the Gluon dQ kernel at B1 S128 H2 Hkv2 d64 compiled through
    ``JITFunction.run(warmup=True)`` and the hand-made build beside it: they differ (the hand-made build's ints are
    plain i32), and the report prints registers and SASS counts for both."""
    if not triton_version().startswith("3.6"):
        pytest.skip(f"compile check targets triton 3.6 (installed: {triton_version() or 'none'})")
    out = _run([_SCRIPT, "dq", "--shape", "1,128,2,2,64", "--compare-checked"])
    assert "hand-made build: a different build" in out
    assert "constexpr 1 | i32: " in out and "group_size" in out
    assert "SASS instructions" in out and "registers (launch)" in out
