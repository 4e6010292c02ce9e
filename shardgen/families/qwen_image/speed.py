"""Qwen-Image without recompilation and with true CFG in one transformer call.

Three thin hooks on a built ``QwenImagePipeline`` or ``QwenImageEditPipeline`` (its ``__call__`` stays diffusers'
own; the edit pipeline's transformer calls differ only in what they carry: the input image's latent tokens after the
sample's in ``hidden_states``, two ``img_shapes`` a sample, and its vision tokens in the text, which the hooks pass
through as they pass the rest):

- **text-length buckets** (``install_text_buckets``): ``pipe.encode_prompt`` trims the prompt
  embeddings to the longest prompt of the batch, so every batch brings a new text length and the
  compiled blocks recompile (``image_rotary_emb[1]`` size). The wrapper pads embeddings and mask to the
  smallest of ``TEXT_BUCKETS`` that holds them. The transformer masks padded text tokens as attention
  keys, their queries only produce text-stream outputs that are thrown away, and the text RoPE
  positions of the real tokens do not move (padding goes at the end): the image tokens see exactly
  the same values, so the pixels are those of the unpadded call (tests/test_qwen_speed.py checks
  them on a scaled-down Qwen-Image on CPU).
- **true CFG batched** (``install_cfg_batching``): with ``true_cfg_scale > 1`` the pipeline calls the
  transformer twice per step on the same latents, with the prompt's and the negative prompt's
  embeddings. The wrapper recognises the pair by identity (the two ``encode_prompt`` results of the
  call, the same ``latents`` object), runs both in one call of twice the batch and hands the
  unconditional half back at the second call.
- **real-valued RoPE** (``enable_real_rope``, with ``compile``): Qwen's RoPE multiplies complex
  tensors, which inductor does not generate code for (it falls back, and warns). The transformer's
  ``pos_embed`` output is turned into (cos, sin) pairs once per call and the rotation done on real
  tensors: the same float32 arithmetic as the complex product.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardgen.speed.blocks import repeated_blocks
from shardgen.speed.fp8 import is_tensor_parallel
from shardgen.speed.fused_kernels import for_layer
from shardgen.speed.prefix_attention import prefix_attention, prefix_lengths  # noqa: F401 (registers the op)
from shardgen.families.qwen_image.fused import fused_qk, fused_qk_applies

log = logging.getLogger("shardgen.qwen")

TEXT_BUCKETS = (128, 256, 512, 1024, 1536, 2048, 3072)
"""Text lengths the prompt embeddings are padded to. Qwen's template leaves ~1.3 tokens per word, so all
of PartiPrompts (1-70 words) lands in 128: one shape for a whole run. Longer prompts take the next one.
Qwen-Image-Edit's text holds the input image's vision tokens too (1369 at 1024x1024, about as many at any aspect
ratio: the pipeline resizes the image to ~1 megapixel), so its prompts land in 1536. None above 3072: the
transformer's text RoPE table ends at position 4096 minus half the latent side, which a padded text must not pass
where the unpadded one would not."""
_ORIG = "_shardgen_orig_"


def is_qwen_image(pipe: Any) -> bool:
    """True for diffusers' QwenImagePipeline and QwenImageEditPipeline (by class, subclasses included)."""
    import diffusers

    classes = tuple(c for c in (getattr(diffusers, n, None) for n in ("QwenImagePipeline", "QwenImageEditPipeline"))
                    if c is not None)  # older diffusers: no Qwen-Image at all
    return bool(classes) and isinstance(pipe, classes)


def bucket_length(n: int, buckets: tuple[int, ...] = TEXT_BUCKETS) -> int:
    """The smallest bucket holding ``n`` tokens (``n`` itself when longer than every bucket)."""
    return next((b for b in buckets if b >= n), n)


def pad_text(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeds, mask) padded with zeros / masked positions at the end up to ``length`` tokens. A missing
    mask (diffusers drops it when no token is padding) becomes an all-ones one, so the shape and the
    kind of inputs stay the same from batch to batch."""
    b, n = embeds.shape[:2]
    if mask is None:
        mask = torch.ones(b, n, dtype=torch.long, device=embeds.device)
    if n < length:
        embeds = torch.cat([embeds, embeds.new_zeros(b, length - n, *embeds.shape[2:])], dim=1)
        mask = torch.cat([mask, mask.new_zeros(b, length - n)], dim=1)
    return embeds, mask


# --- hooks on the pipeline ---------------------------------------------------------------------------

class _Recorder:
    """The last two ``encode_prompt`` results: (prompt, negative prompt) within a true-CFG call."""

    def __init__(self):
        self.last: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def add(self, result):
        self.last = (self.last + [result])[-2:]


def install_text_buckets(pipe, buckets: tuple[int, ...] = TEXT_BUCKETS) -> _Recorder:
    """Wrap ``pipe.encode_prompt`` so its embeddings come padded to a bucket length (idempotent)."""
    rec = pipe.__dict__.get("_shardgen_text_recorder")
    if rec is not None:
        return rec
    rec = _Recorder()
    orig = pipe.encode_prompt

    def encode_prompt(*args, **kwargs):
        embeds, mask = orig(*args, **kwargs)
        out = pad_text(embeds, mask, bucket_length(embeds.shape[1], buckets))
        rec.add(out)
        return out

    pipe.__dict__["encode_prompt"] = encode_prompt
    pipe.__dict__["_shardgen_text_recorder"] = rec
    return rec


def remove_text_buckets(pipe) -> None:
    pipe.__dict__.pop("encode_prompt", None)
    pipe.__dict__.pop("_shardgen_text_recorder", None)


def install_cfg_batching(pipe) -> None:
    """Run the conditional and unconditional transformer calls of each true-CFG step as one call
    (needs ``install_text_buckets``, which records the two embeddings; idempotent)."""
    rec = install_text_buckets(pipe)
    tr = pipe.transformer
    if _ORIG + "forward" in tr.__dict__:
        return
    forward = tr.forward
    pending: dict[str, Any] = {}

    def batched_forward(*args, **kwargs):
        hidden, text = kwargs.get("hidden_states"), kwargs.get("encoder_hidden_states")
        if args or hidden is None or text is None:  # not the pipeline's keyword call: leave it alone
            return forward(*args, **kwargs)
        if pending and text is pending["text"] and hidden is pending["hidden"]:
            out = pending.pop("out")
            pending.clear()
            return out
        pending.clear()
        pair = rec.last
        if len(pair) != 2 or text is not pair[0][0] or pair[1][0].shape[0] != text.shape[0]:
            return forward(*args, **kwargs)  # no true CFG in this call
        cond, uncond = _cfg_call(forward, kwargs, pair)
        pending.update(text=pair[1][0], hidden=hidden, out=uncond)
        return cond

    tr.__dict__[_ORIG + "forward"] = forward
    tr.__dict__["forward"] = batched_forward


def remove_cfg_batching(pipe) -> None:
    tr = pipe.transformer
    if tr.__dict__.pop(_ORIG + "forward", None) is not None:
        tr.__dict__.pop("forward", None)


def _cfg_call(forward, kwargs: dict, pair) -> tuple[Any, Any]:
    """One transformer call on [cond; uncond]; the outputs split back into the pipeline's structure."""
    (c_emb, c_mask), (u_emb, u_mask) = pair
    n = max(c_emb.shape[1], u_emb.shape[1])
    c_emb, c_mask = pad_text(c_emb, c_mask, n)
    u_emb, u_mask = pad_text(u_emb, u_mask, n)
    b = c_emb.shape[0]
    kw = dict(kwargs, encoder_hidden_states=torch.cat([c_emb, u_emb]),
              encoder_hidden_states_mask=torch.cat([c_mask, u_mask]))
    if "text_lengths" in (kwargs.get("attention_kwargs") or {}):  # the lengths hook saw the conditional call only
        lengths = [text_lengths(m, b, n) for m in (c_mask, u_mask)]
        extra = dict(kwargs["attention_kwargs"])
        extra.pop("text_lengths")
        if all(x is not None for x in lengths):
            extra["text_lengths"] = torch.cat(lengths)
        kw["attention_kwargs"] = extra
    for key in ("hidden_states", "timestep", "guidance"):
        if isinstance(kwargs.get(key), torch.Tensor):
            kw[key] = torch.cat([kwargs[key], kwargs[key]])
    if isinstance(kwargs.get("img_shapes"), list):
        kw["img_shapes"] = kwargs["img_shapes"] * 2
    out = forward(**kw)
    if isinstance(out, tuple):
        return (out[0][:b],) + out[1:], (out[0][b:],) + out[1:]
    return type(out)(sample=out.sample[:b]), type(out)(sample=out.sample[b:])


# --- one compiled graph for every text length ------------------------------------------------------------

def mark_text_dynamic(transformer: torch.nn.Module) -> int:
    """Compiled Qwen-Image blocks take the text length as a dynamic dimension (idempotent); how many blocks.

    Static, each text bucket would compile a graph of its own (128 / 256 / 512 tokens: 16-25 s each on an H200,
    even from a warm cache); marked dynamic on the first call, one graph serves every length. The buckets
    stay: they keep the number of attention shapes (kernel plans) small. Dims of size 1 stay static."""
    n = 0
    for block in repeated_blocks(transformer):
        forward = block.__dict__.get("forward")
        if forward is None or getattr(forward, "_shardgen_text_dynamic", False):
            continue
        block.__dict__["forward"] = _text_dynamic(forward)
        n += 1
    return n


def _text_dynamic(forward):
    def text_dynamic_forward(*args, **kwargs):
        text, mask, rope = (kwargs.get(k) for k in ("encoder_hidden_states", "encoder_hidden_states_mask",
                                                     "image_rotary_emb"))
        for tensor, dim in ((text, 1), (mask, 1), (rope[1] if isinstance(rope, (tuple, list)) else None, 0)):
            if isinstance(tensor, torch.Tensor) and tensor.dim() > dim:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return forward(*args, **kwargs)

    text_dynamic_forward._shardgen_text_dynamic = True
    return text_dynamic_forward


# --- real-valued RoPE --------------------------------------------------------------------------------

def rope_real(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_emb_qwen(x, freqs_cis, use_real=False)`` with ``freqs`` as (S, D/2, 2) real
    (cos, sin) pairs: x is (B, S, H, D), its consecutive channel pairs are the complex numbers."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf.unbind(-1)
    cos, sin = freqs[..., 0].unsqueeze(1), freqs[..., 1].unsqueeze(1)
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(3).type_as(x)


def _dispatching_rope(orig):
    def apply_rotary_emb_qwen(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        if not use_real and isinstance(freqs_cis, torch.Tensor) and not freqs_cis.is_complex():
            return rope_real(x, freqs_cis)
        return orig(x, freqs_cis, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim)

    apply_rotary_emb_qwen._shardgen_orig = orig
    return apply_rotary_emb_qwen


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Qwen's rotation of ``x`` by ``freqs`` in whichever form they come: complex (diffusers' own) or real
    (cos, sin) pairs (``enable_real_rope``). The form is the ``pos_embed`` hook's alone, so a processor made
    while the blocks ran eagerly keeps working after they switch to compiled ones that take real frequencies."""
    if isinstance(freqs, torch.Tensor) and not freqs.is_complex():
        return rope_real(x, freqs)
    return _stock_rope()(x, freqs, use_real=False)


@functools.lru_cache(maxsize=None)
def _stock_rope():
    """diffusers' own ``apply_rotary_emb_qwen`` (under ``enable_real_rope``'s dispatcher, if installed), looked up once
    rather than at each of the blocks' calls."""
    from diffusers.models.transformers import transformer_qwenimage as tq

    return getattr(tq.apply_rotary_emb_qwen, "_shardgen_orig", tq.apply_rotary_emb_qwen)


def _as_real(module, args, output):
    """pos_embed's (image, text) complex frequencies as real (cos, sin) pairs, made once per call."""
    return tuple(torch.view_as_real(f).clone() if f.is_complex() else f for f in output)


def enable_real_rope(transformer: torch.nn.Module) -> bool:
    """Qwen-Image transformers: RoPE on real tensors from now on (idempotent); False for other models.

    The attention processor calls diffusers' module-level ``apply_rotary_emb_qwen``; it is replaced once
    per process by a dispatcher that takes the real path for real frequencies and calls the original
    for complex ones, so transformers without the ``pos_embed`` hook below behave exactly as before."""
    try:
        from diffusers.models.transformers import transformer_qwenimage as tq
    except ImportError:
        return False
    if not isinstance(transformer, tq.QwenImageTransformer2DModel) or not isinstance(transformer.pos_embed, tq.QwenEmbedRope):
        return False
    if not hasattr(tq.apply_rotary_emb_qwen, "_shardgen_orig"):
        tq.apply_rotary_emb_qwen = _dispatching_rope(tq.apply_rotary_emb_qwen)
    if "_shardgen_rope_hook" not in transformer.__dict__:
        transformer.__dict__["_shardgen_rope_hook"] = transformer.pos_embed.register_forward_hook(_as_real)
    return True


def disable_real_rope(transformer: torch.nn.Module) -> None:
    hook = transformer.__dict__.pop("_shardgen_rope_hook", None)
    if hook is not None:
        hook.remove()


# --- joint attention without the key-padding mask ----------------------------------------------------------

_LENGTHS = WeakIdKeyDictionary()  # mask tensor -> (its version, its prefix lengths): one host copy per mask


def text_lengths(mask: torch.Tensor | None, batch: int, text_len: int) -> torch.Tensor | None:
    """Each sample's number of real text tokens (CPU int64), or None when the mask is not a prefix of ones.

    The pipeline passes the same mask object at every step, so it is copied to the host once per call."""
    if mask is None:
        return torch.full((batch,), text_len, dtype=torch.int64)
    if mask.dim() != 2 or tuple(mask.shape) != (batch, text_len):
        return None
    hit = _LENGTHS.get(mask)
    if hit is None or hit[0] != mask._version:
        hit = _LENGTHS[mask] = (mask._version, prefix_lengths(mask))
    return hit[1]


def _lengths_hook(module, args, kwargs):
    """Transformer pre-hook: the text lengths of this call reach every block's processor as an attention kwarg."""
    text = kwargs.get("encoder_hidden_states")
    if args or not isinstance(text, torch.Tensor) or text.dim() != 3:
        return None
    lengths = text_lengths(kwargs.get("encoder_hidden_states_mask"), text.shape[0], text.shape[1])
    if lengths is None:
        return None
    return args, dict(kwargs, attention_kwargs=dict(kwargs.get("attention_kwargs") or {}, text_lengths=lengths))


@functools.lru_cache(maxsize=None)
def _prefix_processor_class():
    """The processor class, made once per process: compiled blocks guard on their processor's type, so a
    second ``enable_prefix_attention`` must not bring a new class (it would compile the blocks again)."""
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    class PrefixAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
        """diffusers' Qwen joint attention with keys and values ordered [image, text] instead of [text, image]:
        each sample's valid keys are then a prefix, and ``prefix_attention`` needs no mask. Queries and outputs
        keep diffusers' order. Without ``text_lengths`` (a call not prepared by ``_lengths_hook``), with an
        attention backend or a parallel config of diffusers', it is the stock processor."""

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                     attention_mask=None, image_rotary_emb=None, text_lengths=None):
            if (text_lengths is None or attention_mask is not None or encoder_hidden_states is None
                    or self._parallel_config is not None or self._attention_backend is not None
                    or text_lengths.shape != (hidden_states.shape[0],)):
                return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                        attention_mask, image_rotary_emb)
            seq_txt, seq_img = encoder_hidden_states.shape[1], hidden_states.shape[1]
            head_dim = attn.inner_dim // attn.heads
            # from here to the attention call: the stock processor's lines (diffusers 0.42)
            img_q, img_k, img_v = (p(hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v))
            txt_q, txt_k, txt_v = (p(encoder_hidden_states).unflatten(-1, (-1, head_dim))
                                   for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if fused_qk_applies(attn, image_rotary_emb, img_q):  # eager on CUDA: norms and RoPE in one pass each
                query, key = fused_qk(attn, img_q, img_k, txt_q, txt_k, image_rotary_emb)
                joint = torch.ops.shardgen.prefix_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                            torch.cat([img_v, txt_v], dim=1), text_lengths, seq_img)
                return self._outputs(attn, joint.flatten(2, 3).to(txt_q.dtype), seq_txt)
            if attn.norm_q is not None:
                img_q = attn.norm_q(img_q)
            if attn.norm_k is not None:
                img_k = attn.norm_k(img_k)
            if attn.norm_added_q is not None:
                txt_q = attn.norm_added_q(txt_q)
            if attn.norm_added_k is not None:
                txt_k = attn.norm_added_k(txt_k)
            if image_rotary_emb is not None:
                img_freqs, txt_freqs = image_rotary_emb
                # the frequencies' form (complex or real pairs) can change when compile=auto switches
                img_q, img_k = apply_rope(img_q, img_freqs), apply_rope(img_k, img_freqs)
                txt_q, txt_k = apply_rope(txt_q, txt_freqs), apply_rope(txt_k, txt_freqs)
            joint = torch.ops.shardgen.prefix_attention(
                torch.cat([txt_q, img_q], dim=1), torch.cat([img_k, txt_k], dim=1), torch.cat([img_v, txt_v], dim=1),
                text_lengths, seq_img)
            return self._outputs(attn, joint.flatten(2, 3).to(txt_q.dtype), seq_txt)

        @staticmethod
        def _outputs(attn, joint: torch.Tensor, seq_txt: int) -> tuple[torch.Tensor, torch.Tensor]:
            """The image and text streams' output projections of the joint attention output ([text, image])."""
            img_out = attn.to_out[0](for_layer(attn.to_out[0], joint[:, seq_txt:, :]))
            if len(attn.to_out) > 1:
                img_out = attn.to_out[1](img_out)  # dropout
            return img_out, attn.to_add_out(for_layer(attn.to_add_out, joint[:, :seq_txt, :]))

    return PrefixAttnProcessor


def enable_prefix_attention(transformer: torch.nn.Module) -> int:
    """Qwen-Image blocks attend without the key-padding mask (idempotent); how many processors were replaced.

    Only blocks whose processor is exactly diffusers' ``QwenDoubleStreamAttnProcessor2_0`` on its default
    backend are changed (a custom or parallel processor keeps running), and none of a tensor-parallel model."""
    try:
        from diffusers.models.transformers import transformer_qwenimage as tq
    except ImportError:
        return 0
    if not isinstance(transformer, tq.QwenImageTransformer2DModel):
        return 0
    if is_tensor_parallel(transformer):
        return 0  # tensor parallel keeps the stock processors, as it keeps FLUX.1's stock blocks (shardgen/families/flux/fused.py)
    cls, n = _prefix_processor_class(), 0
    for block in getattr(transformer, "transformer_blocks", []):
        proc = getattr(getattr(block, "attn", None), "processor", None)
        if type(proc) is not tq.QwenDoubleStreamAttnProcessor2_0 or proc._attention_backend is not None \
                or proc._parallel_config is not None:
            continue
        new = cls()
        new.__dict__["_shardgen_stock"] = proc
        block.attn.processor = new
        n += 1
    if n and "_shardgen_lengths_hook" not in transformer.__dict__:
        transformer.__dict__["_shardgen_lengths_hook"] = transformer.register_forward_pre_hook(
            _lengths_hook, with_kwargs=True)
    return n


def disable_prefix_attention(transformer: torch.nn.Module) -> None:
    """The stock processors back, the lengths hook off."""
    hook = transformer.__dict__.pop("_shardgen_lengths_hook", None)
    if hook is not None:
        hook.remove()
    for block in getattr(transformer, "transformer_blocks", []):
        proc = getattr(getattr(block, "attn", None), "processor", None)
        stock = getattr(proc, "__dict__", {}).get("_shardgen_stock")
        if stock is not None:
            block.attn.processor = stock


# --- the families' hook (families/qwen_image/, qwen_image_edit/: speed_hooks) -----------------------------------

def prepare_speed(pipe, opts) -> dict:
    """Qwen-Image and Qwen-Image-Edit: text buckets when compiled or CFG-batched, batched true CFG (not under
    First-Block-Cache, whose per-branch state needs the two calls), real-valued RoPE when compiled, joint attention
    without the key-padding mask with ``fused_blocks`` on CUDA."""
    if not is_qwen_image(pipe):
        return {}
    batch_cfg = opts.cfg_batching and not opts.first_block_cache
    remove_cfg_batching(pipe)
    remove_text_buckets(pipe)
    disable_real_rope(pipe.transformer)
    if opts.compile or batch_cfg:
        install_text_buckets(pipe)
    if batch_cfg:
        install_cfg_batching(pipe)
    real_rope = opts.compile and enable_real_rope(pipe.transformer)
    dynamic = opts.compile and mark_text_dynamic(pipe.transformer) >= 0
    device = getattr(pipe, "_execution_device", None)
    # CUDA only, like the fused FLUX blocks: CPU runs keep diffusers' exact bytes. Left in place across calls
    # (enable is idempotent): new processors would make the compiled blocks compile again
    prefix = 0
    if opts.fused_blocks and device is not None and torch.device(device).type == "cuda":
        enable_prefix_attention(pipe.transformer)
        prefix = sum(isinstance(b.attn.processor, _prefix_processor_class()) for b in pipe.transformer.transformer_blocks)
    else:
        disable_prefix_attention(pipe.transformer)
    return {"qwen": {"text_buckets": opts.compile or batch_cfg, "cfg_batching": batch_cfg, "real_rope": real_rope,
                     "text_length_dynamic": dynamic, "prefix_attention_blocks": int(prefix)}}
