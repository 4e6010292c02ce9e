"""``sdpa_backend=auto_8bit`` (LOSSY, what ``speed=fast`` asks for): the 8-bit attention kernel measured faster than
lossless attention for the run's model, where this GPU runs it; ``auto`` (lossless) elsewhere. The choice is made
once per run, by global rank 0 of the first launch that gets this far, and pinned in ``RUN_DIR/attention.json``:
every later launch, requeue and replica of the run uses it, so a run's samples never mix 8-bit and lossless
attention. A launch on a machine that cannot run the pinned kernel is refused in one line before any weight is
read. While the run holds no sample, a launch decides again (a first launch on a machine without the kernel does
not bind the run); a launch whose choice was replaced so while it loaded its model stops before its first batch
(``check_unchanged``).

Which kernel pays is the family's measurement (``ModelFamily.eight_bit_attention``): FlashAttention-3's float8
kernel for FLUX.1 and FLUX.2 on Hopper (docs/lossy.md); none for the others (on Qwen-Image it is no faster).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from typing import Any

from shardgen.config.schema import EIGHT_BIT_ATTENTION
from shardgen.dataio.rundir.layout import RunDir
from shardgen.dataio.rundir.liveness import host_name
from shardgen.dataio.rundir.storage import RunDirError
from shardgen.errors import UserError

log = logging.getLogger("shardgen")

AUTO_8BIT = "auto_8bit"


class PinnedKernelUnavailable(UserError, RuntimeError):
    """The run's pinned 8-bit attention kernel cannot run on this launch's GPU."""


class AttentionChoiceChanged(UserError, RuntimeError):
    """Another launch chose the run's attention again while this one loaded its model."""


class MissingPin(RunDirError):
    """The run holds samples and no attention.json: which attention made them is not known."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``auto_8bit`` runs for a run: ``sdpa_backend`` (an 8-bit kernel's name, or ``auto``), why, and the GPU
    and host it was chosen on."""

    sdpa_backend: str
    why: str
    gpu: str
    host: str = ""

    def record(self) -> bytes:
        """attention.json's bytes."""
        return (json.dumps(dict(dataclasses.asdict(self), asked=AUTO_8BIT, time=time.time()), indent=1,
                           sort_keys=True) + "\n").encode()


def choose(pipeline: str, device: Any, attention_backend: str | None = None) -> Choice:
    """The kernel ``auto_8bit`` takes for the model of ``pipeline`` on ``device``, a rank's (no run file read)."""
    import torch

    from shardgen.families import family_of
    from shardgen.run.rates import device_name
    from shardgen.speed.sdpa import eight_bit_kernel

    gpu, family = device_name(device), family_of(pipeline)
    kernel = family.eight_bit_attention if family is not None else None
    if kernel is None:
        name = family.name if family is not None else pipeline
        return Choice("auto", f"no 8-bit attention kernel was measured faster than lossless attention for {name}",
                      gpu, host_name())
    if attention_backend not in (None, "native"):
        return Choice("auto", f"the strategy's attention runs through diffusers' {attention_backend} backend, not "
                      "torch's SDPA", gpu, host_name())
    why = eight_bit_kernel(kernel).unavailable_reason(torch.device(device))
    if why:
        return Choice("auto", why, gpu, host_name())
    return Choice(kernel, f"{kernel} is faster than lossless attention for {family.name} on this GPU", gpu,
                  host_name())


def read_pin(run: RunDir) -> Choice | None:
    """The run's pinned choice (``RUN_DIR/attention.json``), None when there is none yet; RunDirError naming the file
    when it is damaged."""
    if not run.files.present(run.attention_path):
        return None
    state = run.files.state(run.attention_path, {"sdpa_backend": str})
    if state["sdpa_backend"] not in ("auto", *EIGHT_BIT_ATTENTION):
        raise RunDirError(f"{run.files.where(run.attention_path)} pins sdpa_backend={state['sdpa_backend']!r}, which "
                          f"is none of auto, {', '.join(EIGHT_BIT_ATTENTION)}: it was not written by shardgen. "
                          "Restore it, or start a new run_dir")
    return Choice(state["sdpa_backend"], *(str(state.get(k, "")) for k in ("why", "gpu", "host")))


def decision(run: RunDir, pipeline: str, device: Any, attention_backend: str | None = None,
             allow_change: bool = False) -> tuple[Choice | None, Choice]:
    """(the run's pinned choice or None, the choice this launch takes) as the run's files say now, reading only:
    the pinned one once the run holds a sample, else this rank's (``choose``). MissingPin for a run holding samples
    without a pin, unless ``allow_change`` (``allow_fingerprint_change``: the user lets this launch's settings take
    the run over). ``pin`` writes what it decides; ``dry_run=true`` says it."""
    from shardgen.dataio.resume import holds_no_samples

    pinned = read_pin(run)
    if pinned is not None and not holds_no_samples(run):
        return pinned, pinned
    if pinned is None and not allow_change and not holds_no_samples(run):
        raise missing_pin(run)
    return pinned, choose(pipeline, device, attention_backend)


def pin(run: RunDir, pipeline: str, device: Any, attention_backend: str | None = None,
        allow_change: bool = False) -> Choice:
    """The run's choice (``decision``), pinned now where it is this rank's (exclusively: of two launches pinning at
    once, both take the first's). While the run holds no sample, this rank's choice replaces a different pinned
    one."""
    from shardgen.dataio.resume import holds_no_samples

    pinned, mine = decision(run, pipeline, device, attention_backend, allow_change)
    if mine is pinned:
        return pinned
    if pinned is None:
        if run.files.create(run.attention_path, mine.record()):
            return mine
        return read_pin(run) or mine
    if pinned.sdpa_backend != mine.sdpa_backend:
        run.files.replace(run.attention_path, mine.record())
        # a launch that marked itself generating in the meantime took the old pin: put it back, and take it too
        if not holds_no_samples(run):
            run.files.replace(run.attention_path, pinned.record())
            return read_pin(run) or pinned
        log.info("sdpa_backend=auto_8bit: %s holds no sample yet, so this launch chooses again: %s (was %s)",
                 run.name, mine.sdpa_backend, pinned.sdpa_backend)
        return mine
    return pinned


def missing_pin(run: RunDir) -> MissingPin:
    """The error of a run that holds samples and no pin."""
    return MissingPin(
        f"{run.files.where(run.attention_path)} is missing, and {run.name} holds samples: which attention made them "
        "is not known (each sample's json names it under lossy.sdpa). Restore the file, launch with "
        "allow_fingerprint_change=true to pin this launch's choice for the samples still to make, or start a new "
        "run_dir")


def with_choice(cfg: Any, choice: Choice) -> Any:
    """``cfg`` with ``sdpa_backend`` the chosen kernel (a copy: the launch's config stays as asked)."""
    out = copy.deepcopy(cfg)
    out.sdpa_backend = choice.sdpa_backend
    return out


def check_runs_here(run: RunDir, choice: Choice, device: Any) -> None:
    """PinnedKernelUnavailable when the pinned kernel cannot run on this rank's ``device`` (before any weight)."""
    import torch

    from shardgen.speed.sdpa import eight_bit_kernel

    if choice.sdpa_backend not in EIGHT_BIT_ATTENTION:
        return
    why = eight_bit_kernel(choice.sdpa_backend).unavailable_reason(torch.device(device))
    if why:
        raise PinnedKernelUnavailable(
            f"sdpa_backend=auto_8bit: {run.name} makes its samples with {choice.sdpa_backend}, chosen at its first "
            f"launch on {choice.gpu or 'another GPU'} ({run.files.where(run.attention_path)}), and it cannot run here: "
            f"{why}. Continue the run where it runs (a Hopper GPU with fa3-fwd installed for fa3_fp8), or start a "
            "new run_dir")


def check_unchanged(run: RunDir, choice: Choice) -> None:
    """AttentionChoiceChanged when the run's pin is no longer ``choice``: while this launch loaded its model (the run
    holding no sample yet), another launch on another kind of GPU chose again. Called once this launch's
    ``start_generating`` marker is written: from then on no launch chooses again, so the run's samples share one
    kernel."""
    pinned = read_pin(run)
    if pinned is None or pinned.sdpa_backend != choice.sdpa_backend:
        now = pinned.sdpa_backend if pinned is not None else "nothing"
        raise AttentionChoiceChanged(
            f"sdpa_backend=auto_8bit: {run.files.where(run.attention_path)} changed while this launch loaded its "
            f"model: it chose {choice.sdpa_backend}, and another launch (on {pinned.gpu if pinned else 'another GPU'})"
            f" has since pinned {now} for {run.name}. Launch again: this launch then takes the run's pin")
