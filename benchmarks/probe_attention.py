"""Joint attention with padded text on one GPU: which kernel runs, how fast, how exact.

    python benchmarks/probe_attention.py [--out DIR]

Qwen-Image masks its padded text tokens as attention keys (diffusers builds a (B, 1, 1, S) boolean mask), which
keeps SDPA off its unmasked fast path. This probe times, at Qwen-Image's 1024x1024 shape (4096 image tokens,
text padded to 128, 24 heads of 128) and at FLUX shapes (unmasked), each way of computing the same masked
attention, and compares each output with a float32 reference (image-token rows and real text rows):

- ``mask_<kernel>``: SDPA with diffusers' boolean mask, the kernel forced (cudnn / efficient / flash);
  ``mask_float_<kernel>``: the same mask as an additive 0/-inf bias; ``mask_auto``: torch's own choice and
  ``mask_cudnn_first``: shardgen's priority order (cuDNN first, set_priority) with the boolean mask;
- ``prefix_<kernel>``: keys and values ordered [image, text], so each sample's valid keys are a prefix; one
  unmasked call per sample on that prefix (the lengths known on the host);
- ``gather_cudnn``: [text, image] order kept, each sample's valid keys copied out (cat) before its call;
- ``flex``: compiled flex_attention with a key-padding block mask.
``unmasked_<kernel>`` is the same call without any mask (a different result: the speed ceiling).
Results: ``$OUT/probe_attention.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "flash": SDPBackend.FLASH_ATTENTION}


def timed(fn, iters=10, warm=2) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def kernels_of(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if e.device_type.name == "CUDA"}
    return sorted(n[:90] for n in names if any(w in n.lower() for w in ("fmha", "attention", "cudnn", "flash", "sdpa", "triton")))[:6]


def qwen_case(batch, heads, txt, img, dim, lengths, device, dtype):
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(batch, txt + img, heads, dim, device=device, dtype=dtype, generator=g) for _ in range(3))
    mask_txt = torch.arange(txt, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    mask = torch.cat([mask_txt, torch.ones(batch, img, dtype=torch.bool, device=device)], 1)[:, None, None, :]
    return q, k, v, mask


def reference(q, k, v, lengths, txt):
    """float32, per sample, only the valid keys: the exact masked attention."""
    outs = []
    for i, n in enumerate(lengths):
        keep = torch.cat([torch.arange(n), torch.arange(txt, k.shape[1])]).to(k.device)
        qi, ki, vi = (t[i:i + 1].float().transpose(1, 2) for t in (q, k[:, keep], v[:, keep]))
        with sdpa_kernel([SDPBackend.MATH]):
            outs.append(F.scaled_dot_product_attention(qi, ki, vi))
    return torch.cat(outs).transpose(1, 2)  # (B, S, H, D)


def error(out, ref, lengths, txt) -> dict:
    """relative RMS error of the image rows and of the real text rows (padded text rows are thrown away)."""
    img = (out[:, txt:].float() - ref[:, txt:]).pow(2).mean().sqrt() / ref[:, txt:].pow(2).mean().sqrt()
    rows = [(out[i, :n].float() - ref[i, :n]) for i, n in enumerate(lengths)]
    ref_rows = [ref[i, :n] for i, n in enumerate(lengths)]
    t = torch.cat(rows).pow(2).mean().sqrt() / torch.cat(ref_rows).pow(2).mean().sqrt()
    return {"rel_rms_image": float(img), "rel_rms_text": float(t)}


def qwen_variants(q, k, v, mask, lengths, txt):
    """name -> callable returning (B, S, H, D) outputs in [text, image] order."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # diffusers' native backend: (B, H, S, D) views
    fmask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    img = q.shape[1] - txt
    # [image, text] order for keys/values: valid keys are a prefix of img + n
    k_it = torch.cat([kt[:, :, txt:], kt[:, :, :txt]], 2)
    v_it = torch.cat([vt[:, :, txt:], vt[:, :, :txt]], 2)
    ways = {}

    def sdpa(kernels, m, set_priority=False):
        def run():
            ctx = sdpa_kernel(kernels, set_priority=True) if set_priority else sdpa_kernel(kernels)
            with ctx:
                return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m).transpose(1, 2)
        return run

    for name, kern in KERNELS.items():
        ways[f"unmasked_{name}"] = sdpa([kern], None)
        ways[f"mask_{name}"] = sdpa([kern], mask)
        ways[f"mask_float_{name}"] = sdpa([kern], fmask)
    ways["mask_auto"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    ways["mask_cudnn_first"] = sdpa([KERNELS["cudnn"], KERNELS["flash"], KERNELS["efficient"], SDPBackend.MATH], mask,
                                    set_priority=True)

    def prefix(kern):
        def run():
            with sdpa_kernel([kern]):
                outs = [F.scaled_dot_product_attention(qt[i:i + 1], k_it[i:i + 1, :, :img + n], v_it[i:i + 1, :, :img + n])
                        for i, n in enumerate(lengths)]
            return torch.cat(outs).transpose(1, 2)
        return run

    for name, kern in KERNELS.items():
        ways[f"prefix_{name}"] = prefix(kern)

    def prefix_batched_cudnn():  # same lengths share a call
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(n, []).append(i)
        out = torch.empty_like(qt)
        with sdpa_kernel([KERNELS["cudnn"]]):
            for n, idx in groups.items():
                ix = torch.tensor(idx, device=q.device)
                out[ix] = F.scaled_dot_product_attention(qt[ix], k_it[ix, :, :img + n], v_it[ix, :, :img + n])
        return out.transpose(1, 2)
    ways["prefix_grouped_cudnn"] = prefix_batched_cudnn

    def gather():
        with sdpa_kernel([KERNELS["cudnn"]]):
            outs = [F.scaled_dot_product_attention(
                qt[i:i + 1], torch.cat([kt[i:i + 1, :, :n], kt[i:i + 1, :, txt:]], 2),
                torch.cat([vt[i:i + 1, :, :n], vt[i:i + 1, :, txt:]], 2)) for i, n in enumerate(lengths)]
        return torch.cat(outs).transpose(1, 2)
    ways["gather_cudnn"] = gather

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        lens = torch.tensor(lengths, device=q.device)

        def keep(b, h, q_idx, kv_idx):
            return kv_idx < img + lens[b]
        bm = create_block_mask(keep, q.shape[0], None, q.shape[1], q.shape[1], device=q.device)
        flex = torch.compile(flex_attention, dynamic=False)
        ways["flex"] = lambda: flex(qt, k_it, v_it, block_mask=bm).transpose(1, 2)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        ways["flex"] = e
    return ways


def flops(batch, heads, sq, sk, dim):
    return 4 * batch * heads * sq * sk * dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "cases": {}}
    B, H, T, N, D = 4, 24, 128, 4096, 128
    for case, lengths in {"cond_mixed": [17, 45, 90, 128], "uncond": [4, 4, 4, 4], "full": [128] * 4}.items():
        q, k, v, mask = qwen_case(B, H, T, N, D, lengths, dev, dt)
        ref = reference(q, k, v, lengths, T)
        rows = {}
        for name, fn in qwen_variants(q, k, v, mask, lengths, T).items():
            if isinstance(fn, Exception):
                rows[name] = {"error": f"{type(fn).__name__}: {str(fn)[:300]}"}
                continue
            try:
                out = fn()
                ms = timed(fn)
                useful = sum(flops(1, H, T + N, N + n, D) for n in lengths)
                rows[name] = {"ms": round(ms, 3), "tflops_useful": round(useful / ms / 1e9, 1),
                              **error(out, ref, lengths, T)}
                if name.startswith(("mask_auto", "mask_cudnn_first", "prefix_cudnn", "mask_cudnn")):
                    rows[name]["kernels"] = kernels_of(fn)
            except Exception as e:  # noqa: BLE001
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(case, name, rows[name], flush=True)
        res["cases"][f"qwen_{case}"] = rows
        del q, k, v, mask, ref
        torch.cuda.empty_cache()
    for label, (b, h, s) in {"flux1_b4": (4, 24, 4608), "flux2_b4": (4, 48, 4608), "flux2_b1": (1, 48, 4608)}.items():
        g = torch.Generator(dev).manual_seed(0)
        q, k, v = (torch.randn(b, s, h, D, device=dev, dtype=dt, generator=g).transpose(1, 2) for _ in range(3))
        rows = {}
        for name, kern in KERNELS.items():
            try:
                def fn():
                    with sdpa_kernel([kern]):
                        return F.scaled_dot_product_attention(q, k, v)
                ms = timed(fn)
                rows[name] = {"ms": round(ms, 3), "tflops": round(flops(b, h, s, s, D) / ms / 1e9, 1)}
            except Exception as e:  # noqa: BLE001
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(label, name, rows[name], flush=True)
        res["cases"][label] = rows
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe_attention.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
