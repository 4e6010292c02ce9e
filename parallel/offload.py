"""Streaming a text encoder that does not fit its GPU: diffusers' group offloading copies its layers in one by one for
each encoding, from a pinned copy in the machine's RAM on a side stream while the previous layer computes.

strategy=device_map uses it for an encoder too large to sit beside the transformer even to encode (FLUX.2-dev's 24B
Mistral beside its transformer on an 80 GB card). The pinned copy is packed into blocks that torch's caching host
allocator pins without rounding (it rounds each pinned allocation up to a power of two: pinned tensor by tensor, as
group offloading does, FLUX.2-dev's 44.7 GiB encoder would take 71.1 GiB), and is made only where the machine's RAM
holds it; otherwise the encoder streams from pageable memory, without the side stream.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("shardgen.device_map")
MIN_BLOCK = 1 << 30
"""Bytes of a pinned block at least (a power of two); a block is the largest tensor's size rounded up to a power of two
when that is more."""
ALIGN = 512
"""Bytes each tensor's place in a block is aligned to."""


def room_to_encode(device: torch.device, reserve_fraction: float) -> int | None:
    """Bytes an encoder may take on ``device`` to encode: what is free to this process (free on the card plus what its
    caching allocator holds unused) less ``reserve_fraction`` of the card; None off a GPU (no limit)."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free - torch.cuda.get_device_properties(device).total_memory * reserve_fraction)


def stream_plan(sizes: dict[str, int], free: int) -> list[str]:
    """The encoders to stream (pure): the largest first while the ones left moved whole together exceed ``free``
    (they are moved in together for a batch's encoding)."""
    streamed, left = [], dict(sizes)
    while left and sum(left.values()) > free:
        largest = max(left, key=left.get)
        streamed.append(largest)
        del left[largest]
    return streamed


def block_plan(sizes: list[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Where each tensor of ``sizes`` (bytes) goes in the pinned blocks (pure): (each block's bytes, and per tensor,
    largest first, (its index, its block, its offset)); first fit, largest first, offsets aligned to ``ALIGN``."""
    largest = max(sizes, default=0)
    block = max(MIN_BLOCK, 1 << max(0, (largest - 1).bit_length()))
    blocks, used, places = [], [], []
    for i in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        n = -(-sizes[i] // ALIGN) * ALIGN
        b = next((j for j, u in enumerate(used) if u + n <= block), None)
        if b is None:
            blocks.append(block)
            used.append(0)
            b = len(blocks) - 1
        places.append((i, b, used[b]))
        used[b] += n
    return blocks, places


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's parameters and buffers with data on the CPU, each once (tied weights are one)."""
    seen = {}
    for t in (*module.parameters(), *module.buffers()):
        if t.numel() and t.device.type == "cpu":
            seen.setdefault(id(t), t)
    return list(seen.values())


def pinned_bytes(module: torch.nn.Module) -> int:
    """Host memory the packed pinned copy of ``module`` takes (``block_plan``'s blocks)."""
    return sum(block_plan([t.numel() * t.element_size() for t in _tensors(module)])[0])


def pack(module: torch.nn.Module, pin: bool = True) -> int:
    """Move ``module``'s CPU tensors into blocks allocated as ``block_plan`` says (pinned with ``pin``), each tensor's
    own memory freed as soon as it is copied (a block is allocated when first used: the peak is the weights and about
    one block more); the blocks' bytes."""
    tensors = _tensors(module)
    sizes = [t.numel() * t.element_size() for t in tensors]
    blocks, places = block_plan(sizes)
    made: dict[int, torch.Tensor] = {}
    for i, b, offset in places:
        if b not in made:
            made[b] = torch.empty(blocks[b], dtype=torch.uint8, pin_memory=pin)
        t = tensors[i]
        view = made[b][offset:offset + sizes[i]].view(t.dtype).view(t.shape)
        view.copy_(t.data)
        t.data = view
    return sum(blocks)


def release_cached_pinned() -> None:
    """Return to the system the pinned blocks torch's host caching allocator holds unused: a streamed encoder of an
    earlier job in this process (the GPU tests, one job after another) goes back to that cache when collected, not to
    the system, and the RAM it keeps would read as taken. A no-op without CUDA or where this torch has no such call."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        try:
            empty()
        except RuntimeError as e:  # an allocator this torch cannot empty: the RAM check below counts it as taken
            log.debug("the pinned host cache was not emptied: %s", e)


def pin_streamed(pinned: int) -> bool:
    """Whether a streamed encoder whose pinned copy takes ``pinned`` bytes (``pinned_bytes``) gets it: it must fit
    what this rank's share of the machine's RAM has available now (the weights it replaces may be a file's pages,
    which free nothing), once the pinned blocks this process keeps unused are returned (``release_cached_pinned``)."""
    from parallel.memory import available_bytes, local_ranks

    release_cached_pinned()
    available, _ = available_bytes("cpu", local_ranks())
    return available is None or pinned <= available


def stream_encoder(module: torch.nn.Module, device: torch.device, pinned: bool = True) -> None:
    """diffusers' group offloading at leaf level: the weights stay in CPU memory, each layer's copied in for its
    forward; on a GPU with ``pinned``, from the packed pinned copy (``pack``) on a side stream while the previous layer
    computes (group offloading keeps a tensor already pinned as it is)."""
    from diffusers.hooks import apply_group_offloading

    side_stream = pinned and device.type == "cuda"
    if side_stream:
        pack(module, pin=True)
        # group offloading's side stream would pin another copy of each tensor torch does not see as pinned
        side_stream = all(t.is_pinned() for t in _tensors(module))
        if not side_stream:
            log.warning("device_map: the packed copy of %s is not pinned memory as torch sees it: streamed without a "
                        "side stream", type(module).__name__)
    apply_group_offloading(module, onload_device=device, offload_device=torch.device("cpu"), offload_type="leaf_level",
                           use_stream=side_stream)
