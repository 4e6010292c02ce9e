"""Diffusers attention backends as ``strategy.attention_backend`` names them: which names exist, which return the
log-sum-exp (LSE) that ring attention merges its partial results with, and the default for a device. Each strategy
resolves its own backend from these (``Strategy.attention_backend``)."""

from __future__ import annotations

# attention backends (diffusers 0.42 names) whose forward op returns the log-sum-exp ring attention merges with;
# all of them are CUDA kernels for bf16/fp16 inputs. ("native" and "_native_npu" refuse return_lse=True.)
LSE_BACKENDS = frozenset({"_native_cudnn", "_native_flash", "flash", "flash_hub", "flash_varlen_hub", "_flash_3_hub",
                          "_flash_3_varlen_hub", "sage", "sage_hub"})


def backend_name_problem(name: str) -> str | None:
    """Why ``name`` is no diffusers attention backend, listing those that are; None when it is one."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    valid = sorted(b.value for b in AttentionBackendName)
    if name not in valid:
        return f"strategy.attention_backend={name!r} is not a diffusers attention backend; use one of {valid}"
    return None


def default_attention_backend(device_type: str, needs_lse: bool) -> str:
    """CUDA: cuDNN attention when ring needs the LSE, else native SDPA (faster on one H200, see docs/strategies.md);
    CPU: native."""
    return "_native_cudnn" if device_type == "cuda" and needs_lse else "native"



def active_backend():
    """diffusers' process-wide active attention backend, to put back with ``restore_active_backend``: its
    ``set_attention_backend`` (``strategy.attention_backend``) makes the model's backend the process's too, which
    every other model without a backend of its own then uses, so a second job in the same process (a notebook's,
    ``jobs.bench``'s) would inherit the first one's."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry._active_backend


def restore_active_backend(backend) -> None:
    """Put back what ``active_backend`` returned (the models keep the backends set on them)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    _AttentionBackendRegistry.set_active_backend(backend)
