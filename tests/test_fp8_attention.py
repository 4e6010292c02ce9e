"""sdpa_backend=fp8: shardgen's own 8-bit attention (INT8 QK^T, float8 PV). On CPU: what its arithmetic costs
against exact attention (``fp8_attention.reference``, the kernel's arithmetic in torch ops: the GPU tests hold the
kernel to it), which SDPA calls it takes, that it is recorded as lossy and in the fingerprint, and that a CPU run is
refused in one line; with Triton at hand (no GPU), what it compiles to for Hopper and Ada. The kernel itself runs in
tests/test_gpu_fp8.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardgen.quality.gate import lossless
from shardgen.speed import fp8_attention, sdpa, sdpa_route
from shardgen.speed.techniques import AccelError, AccelOptions, validate


def _qkv(heads=2, tokens=300, dim=128, key_offset=3.0, peak=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, tokens, dim, generator=g) for _ in range(3))
    return q * peak, k + key_offset * torch.randn(1, 1, 1, dim, generator=g), v


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.norm()).item()


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("peak", [1.0, 4.0])  # flat and peaked attention
def test_the_arithmetic_costs_a_few_percent_of_exact_attention(dim, peak):
    q, k, v = _qkv(dim=dim, peak=peak)
    exact = F.scaled_dot_product_attention(q, k, v)
    err = _rel(fp8_attention.reference(q, k, v), exact)
    assert 0.005 < err < 0.05, err  # lossy (8-bit products), but within a few percent


def test_smoothing_the_keys_keeps_a_large_common_offset_from_spending_their_range():
    q, k, v = _qkv(key_offset=30.0)
    exact = F.scaled_dot_product_attention(q, k, v)
    assert _rel(fp8_attention.reference(q, k, v), exact) < 0.05

    def unsmoothed(q, k, v):  # the same arithmetic without the mean taken out of the keys
        s = k.abs().amax(-1, keepdim=True) / 127.0
        k8 = torch.round(k / s).clamp(-127, 127) * s
        qs = q.abs().amax(-1, keepdim=True) / 127.0
        return F.scaled_dot_product_attention(torch.round(q / qs) * qs, k8, v)

    assert _rel(unsmoothed(q, k, v), exact) > 0.1  # what the smoothing saves


def test_the_probabilities_keep_their_precision_where_they_are_small():
    """4,600 keys: most probabilities are far below e4m3's smallest normal (2**-6) unless scaled first."""
    q, k, v = _qkv(tokens=4600, heads=1)
    exact = F.scaled_dot_product_attention(q, k, v)
    assert _rel(fp8_attention.reference(q, k, v), exact) < 0.05


def test_takes_only_what_the_kernel_can_do():
    q = torch.randn(1, 2, 4, 128, dtype=torch.bfloat16)
    assert not fp8_attention.takes(q, q, q)  # not on CUDA
    if torch.cuda.is_available():
        c = q.cuda()
        assert fp8_attention.takes(c, c, c) and not fp8_attention.takes(c, c, c, is_causal=True)
        assert not fp8_attention.takes(c[..., :96], c[..., :96], c[..., :96])  # head size 96
        assert not fp8_attention.takes(c, c, c, attn_mask=torch.ones(4, 4, dtype=torch.bool, device="cuda"))
        assert not fp8_attention.takes(c.float(), c.float(), c.float())


@pytest.mark.parametrize("kernel", sdpa.EIGHT_BIT)
def test_the_context_routes_what_the_kernel_takes_and_restores_torch(monkeypatch, kernel):
    """Each 8-bit kernel's context (shardgen/speed/sdpa_route.py)."""
    module = sdpa.eight_bit_kernel(kernel)
    calls = []
    monkeypatch.setattr(module, "attention", lambda q, k, v, scale=None: calls.append(q.shape) or q)
    monkeypatch.setattr(module, "takes", lambda q, k, v, attn_mask=None, **kw: attn_mask is None)
    original = F.scaled_dot_product_attention
    q = torch.randn(1, 2, 4, 64)
    with module.context():
        assert F.scaled_dot_product_attention is not original
        F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    assert F.scaled_dot_product_attention is original
    assert calls == [q.shape]  # the masked call went to torch


def test_it_is_lossy_the_lossless_settings_turn_it_off_and_a_relaunch_with_it_is_another_run():
    from tests.conftest import compose_cfg
    from shardgen.dataio.resume.fingerprint import compute_fingerprint, diff_fingerprints

    opts = AccelOptions(sdpa="fp8", fp8=True)
    assert opts.lossy == {"fp8": True, "sdpa": "fp8"}
    assert lossless(opts).lossy == {} and lossless(opts).sdpa == "auto"
    for name in sdpa.EIGHT_BIT:
        base, other = (compute_fingerprint(compose_cfg(*o), "sha") for o in ((), (f"sdpa_backend={name}",)))
        assert [d.split(":")[0] for d in diff_fingerprints(base, other)] == ["sdpa_backend"], name


def test_a_cpu_run_is_refused_in_one_line():
    with pytest.raises(AccelError) as e:
        validate(AccelOptions(sdpa="fp8"), "cpu")
    assert str(e.value) == ("sdpa_backend=fp8: float8 attention runs on CUDA GPUs only. Use sdpa_backend=auto "
                            "(lossless)")


@pytest.mark.parametrize("kernel", sdpa.EIGHT_BIT)
@pytest.mark.parametrize("kernel_error, refused", [(0.035, False), (0.5, True), (float("nan"), True)])
def test_a_kernel_this_gpu_runs_wrong_is_refused_before_any_sample(monkeypatch, kernel, kernel_error, refused):
    """The self-check (run on the rank when the pipeline is first prepared on a CUDA device) compares the kernel with
    exact attention: here the kernel is the exact answer plus noise of a chosen size, on the CPU."""
    def noisy(exact):
        noise = torch.randn(exact.shape, generator=torch.Generator().manual_seed(1))
        return (exact + noise * kernel_error * exact.norm() / noise.norm()).to(torch.bfloat16)

    module = sdpa.eight_bit_kernel(kernel)
    monkeypatch.setattr(module, "attention", lambda q, k, v, scale=None: noisy(
        F.scaled_dot_product_attention(q.float(), k.float(), v.float())))
    if hasattr(module, "check_parts"):  # its path from the projections is checked the same way
        monkeypatch.setattr(module, "check_parts", lambda q, k, v: noisy(module.check_parts_exact(q, k, v)))
    monkeypatch.setattr(sdpa_route, "_CHECKED", {})
    if refused:
        with pytest.raises(AccelError, match=rf"^sdpa_backend={kernel}: {sdpa.KERNEL_NAMES[kernel]}'s output is "
                                             r"(\d+\.\d|inf)% off exact attention on cpu .*Use sdpa_backend=auto "
                                             rf"\(lossless\) or sdpa_backend={sdpa.OTHER_KERNEL[kernel]}$"):
            sdpa._check_kernel(kernel, "cpu")
    else:
        sdpa._check_kernel(kernel, "cpu")
        names = (kernel, f"{kernel} from projections") if hasattr(module, "check_parts") else (kernel,)
        assert sdpa_route._CHECKED == {(n, "cpu", d): pytest.approx(kernel_error, rel=0.1)
                                       for n in names for d in module.HEAD_DIMS}


@pytest.mark.parametrize("kernel", sdpa.EIGHT_BIT)
def test_a_kernel_that_cannot_build_here_is_refused_in_one_line(monkeypatch, kernel):
    """The kernel's own failure (an older Triton, a driver it does not know) is the run's one-line refusal, naming
    the versions of the packages it runs on and the ways out, not a compiler traceback."""
    def broken(q, k, v, scale=None):
        raise RuntimeError("PassManager::run failed\n  ... 40 lines of MLIR ...")

    monkeypatch.setattr(sdpa.eight_bit_kernel(kernel), "attention", broken)
    monkeypatch.setattr(sdpa_route, "_CHECKED", {})
    with pytest.raises(AccelError) as e:
        sdpa._check_kernel(kernel, "cpu")
    packages = sdpa._package_versions(kernel)
    assert packages.startswith({"fp8": "triton ", "sage": "sageattention ", "fa3_fp8": "fa3-fwd "}[kernel])
    assert str(e.value).startswith(f"sdpa_backend={kernel}: {sdpa.KERNEL_NAMES[kernel]} does not run on cpu with "
                                   f"{packages} (RuntimeError")
    assert str(e.value).endswith("(RuntimeError: PassManager::run failed). Use sdpa_backend=auto (lossless) or "
                                 f"sdpa_backend={sdpa.OTHER_KERNEL[kernel]}")


@pytest.mark.parametrize("kernel", sdpa.EIGHT_BIT)
def test_compiled_blocks_keep_the_8bit_attention_and_lose_it_outside_the_context(monkeypatch, kernel):
    """Under torch.compile each kernel is an operator (shardgen::fp8_attention, shardgen::sage_attention,
    shardgen::fa3_fp8_attention; here all run the float8 kernel's CPU reference arithmetic): a block compiled inside
    the context computes what eager calls do, and outside it torch's exact attention (the block's guard sees torch's
    SDPA again)."""
    from torch._dynamo.backends.debugging import aot_eager

    module = sdpa.eight_bit_kernel(kernel)
    monkeypatch.setattr(module, "takes", lambda q, k, v, attn_mask=None, **kw: attn_mask is None)
    monkeypatch.setattr(module, "attention", lambda q, k, v, scale=None: fp8_attention.reference(q, k, v, scale))

    class Block(torch.nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x + 1.0, x * 2.0) * 3.0

    graphs = []

    def backend(gm, inputs):  # what dynamo traced, then aot_eager as before
        graphs.append({str(n.target) for n in gm.graph.nodes})
        return aot_eager(gm, inputs)

    torch._dynamo.reset()
    block = torch.compile(Block(), backend=backend, fullgraph=True)
    x = torch.randn(1, 2, 40, 64, generator=torch.Generator().manual_seed(0))
    exact = Block()(x)
    with module.context():
        eager, compiled = Block()(x), block(x)
    assert torch.equal(compiled, eager) and 0.005 < _rel(compiled, exact) < 0.05
    assert f"shardgen.{kernel}_attention.default" in graphs[0]  # the operator, not its torch ops traced inline
    assert torch.equal(block(x), exact)
    with module.context():
        assert torch.equal(block(x), eager)
    torch._dynamo.reset()


def interpreted(code: str, tmp_path) -> str:
    """What ``code`` prints, run in a fresh process with Triton's interpreter (Triton kernels on CPU tensors,
    numpy doing the arithmetic); the test is skipped where no Triton can be imported (``_triton_path``)."""
    import os
    import subprocess
    import sys

    path = _triton_path()
    if path is None:
        pytest.skip("needs Triton (its interpreter runs the kernels on the CPU): pip install --target DIR triton, "
                    "then SHARDGEN_TRITON_PATH=DIR")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, str(root)])), "TRITON_INTERPRET": "1",
           "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def _triton_path() -> str | None:
    """Where a Triton with its NVIDIA backend can be imported from: $SHARDGEN_TRITON_PATH (a pip --target folder,
    kept out of the test environment: CPU torch must not find it) or this environment."""
    import importlib.util
    import os

    path = os.environ.get("SHARDGEN_TRITON_PATH")
    if path:
        return path if (Path(path) / "triton" / "backends" / "nvidia").is_dir() else None
    spec = importlib.util.find_spec("triton")
    return "" if spec and (Path(spec.origin).parent / "backends" / "nvidia").is_dir() else None


def test_the_kernel_compiles_to_8bit_tensor_cores_with_pipelined_loads_for_hopper_and_ada(tmp_path):
    """benchmarks/aot_fp8_attention.py compiles the kernel for sm_90 and sm_89 without a GPU: both products on 8-bit
    tensor cores (INT8 Q K^T, e4m3 P V), the key/value loop's loads asynchronous (pipelined), no spills on Hopper."""
    import json
    import os
    import subprocess
    import sys

    path = _triton_path()
    if path is None:
        pytest.skip("needs Triton with its NVIDIA backend (no GPU): pip install --target DIR triton, then "
                    "SHARDGEN_TRITON_PATH=DIR")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, str(root)])),
           "TRITON_DEFAULT_FP_FUSION": "1", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "benchmarks/aot_fp8_attention.py", "--arch", "90,89", "--out",
                           str(tmp_path / "aot.json")], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {(r["arch"], r["head_dim"]): r for r in json.loads((tmp_path / "aot.json").read_text())}
    assert set(rows) == {(a, d) for a in (90, 89) for d in (64, 128)}
    for (arch, dim), row in rows.items():
        kinds = " ".join(row["tensor_core"])
        assert ("wgmma" if arch == 90 else "mma.sync") in kinds and ".s8.s8" in kinds and ".e4m3.e4m3" in kinds, row
        assert row["async_loads"] >= 6, row  # K, V and the key scales, each in flight over the stages
        if arch == 90:
            assert row["spill_bytes"] == 0 and row["shared_bytes"] <= 227 * 1024, row


@pytest.mark.parametrize("kernel", sdpa.EIGHT_BIT)
def test_a_transformer_whose_attention_bypasses_sdpa_is_refused_not_recorded_as_8bit(kernel):
    """Under another diffusers attention backend the 8-bit kernel would never be called while the samples said it
    was: refused when the pipeline is prepared, before any sample (the strategy checks refuse the known cases before
    any weight is read: tests/test_strategies.py)."""
    import types

    class Attention(torch.nn.Module):
        processor = types.SimpleNamespace(_attention_backend="flash")

    transformer = torch.nn.Sequential(Attention())
    step = types.SimpleNamespace(opts=AccelOptions(sdpa=kernel), device=torch.device("cuda"), transformer=transformer)
    with pytest.raises(AccelError) as e:
        sdpa._apply(step)
    assert str(e.value) == (f"sdpa_backend={kernel} replaces torch's SDPA, and this transformer's attention runs "
                            "through another diffusers attention backend: the 8-bit kernel would never run. Set "
                            "sdpa_backend=auto")
