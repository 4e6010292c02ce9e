"""The sampler: ``scheduler=`` picks one of diffusers' flow-matching schedulers in place of the one the model ships
with, ``scheduler_shift=`` its flow shift. One table, name -> diffusers class and the config it needs.

Every family shardgen runs (FLUX.1, FLUX.2, Qwen-Image, SD3, Wan) is a flow-matching model, so each entry is a
scheduler in its flow form (``prediction_type="flow_prediction"``, ``use_flow_sigmas``) built with
``from_config(<the model's scheduler config>, **overrides)``: the model's own settings (train timesteps, shift,
dynamic shifting) carry over. Heun-type schedulers are left out: the image pipelines hand the scheduler custom sigmas
(``retrieve_timesteps(sigmas=...)``), which their ``set_timesteps`` does not take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardgen.errors import ConfigError
from shardgen.models.errors import ModelLoadError


@dataclass(frozen=True)
class SchedulerChoice:
    """One ``scheduler=`` option."""

    cls: str
    """The diffusers scheduler class."""
    config: dict = field(default_factory=dict)
    """What its config needs beyond the model's scheduler config (its flow form)."""
    shift_key: str = "shift"
    """The config entry ``scheduler_shift`` sets."""
    about: str = ""
    pipelines: tuple[str, ...] | None = None
    """The pipeline classes it works in (None: every one shardgen runs)."""


_FLOW = {"prediction_type": "flow_prediction", "use_flow_sigmas": True}
SCHEDULERS = {
    "euler": SchedulerChoice("FlowMatchEulerDiscreteScheduler", about="flow-matching Euler (FLUX, Qwen-Image, SD3's own)"),
    # the image pipelines pass ``mu`` to set_timesteps, which DPM-Solver takes only with dynamic shifting on
    "dpmpp_2m": SchedulerChoice("DPMSolverMultistepScheduler",
                                dict(_FLOW, algorithm_type="dpmsolver++", solver_order=2), "flow_shift",
                                "DPM-Solver++ 2M, multistep", ("WanPipeline", "WanImageToVideoPipeline")),
    "unipc": SchedulerChoice("UniPCMultistepScheduler", dict(_FLOW), "flow_shift", "UniPC, multistep (Wan's own)"),
    "lcm": SchedulerChoice("FlowMatchLCMScheduler", about="flow-matching LCM, for few-step distilled models"),
}


def fitting(pipeline: str) -> list[str]:
    """The ``scheduler=`` options that work in ``pipeline`` (a diffusers pipeline class name)."""
    return [n for n, c in SCHEDULERS.items() if c.pipelines is None or pipeline in c.pipelines]


def check(name: str | None, shift: float | None, pipeline: str) -> None:
    """ConfigError (one line) for a name not in the table or not for ``pipeline``, or a shift that is no positive
    number."""
    if name is not None and name not in fitting(pipeline):
        what = "does not work in " + pipeline if name in SCHEDULERS else "is not a scheduler shardgen knows"
        raise ConfigError(f"scheduler={name}: {what}; use one of {', '.join(fitting(pipeline))}, or null for the "
                         "model's own")
    if shift is not None and not shift > 0:
        raise ConfigError(f"scheduler_shift={shift}: use a positive number (FLUX.1-dev's is 3.0, Wan 480p's 3.0, "
                         "720p's 5.0), or null for the model's")


def apply(pipe: Any, name: str | None, shift: float | None) -> Any:
    """Give ``pipe`` the scheduler ``name`` (None: keep its own) with flow shift ``shift`` (None: the model's; a
    number turns resolution-dependent dynamic shifting off, so that the shift given is the one used)."""
    if name is None and shift is None:
        return pipe
    import diffusers

    own = pipe.scheduler
    choice = SCHEDULERS[name] if name is not None else _choice_of(own)
    overrides = dict(choice.config)
    own_shift = own.config.get("flow_shift", own.config.get("shift"))
    if own_shift is not None:  # the model's shift, under the name the new class gives it
        overrides[choice.shift_key] = own_shift
    if shift is not None:
        overrides.update({choice.shift_key: float(shift), "use_dynamic_shifting": False})
    try:
        pipe.scheduler = getattr(diffusers, choice.cls).from_config(own.config, **overrides)
    except Exception as e:  # a config the class cannot take
        raise ModelLoadError(f"scheduler={name}: {choice.cls} cannot be built from {type(own).__name__}'s config "
                             f"({type(e).__name__}: {e}); use the model's own (scheduler=null)") from None
    return pipe


def _choice_of(scheduler: Any) -> SchedulerChoice:
    """The table's entry for the model's own scheduler (for a shift alone), else its class with a ``shift``."""
    name = type(scheduler).__name__
    return next((c for c in SCHEDULERS.values() if c.cls == name),
                SchedulerChoice(name, shift_key="flow_shift" if "flow_shift" in scheduler.config else "shift"))
