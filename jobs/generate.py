"""The main job: every prompt of a prompt file into one sample of a run directory's webdataset shards.

    python -m jobs.generate                                   # the tiny embedded model, examples/prompts.txt
    python -m jobs.generate prompts=parti prompts.path=PartiPrompts.tsv run_dir=runs/parti
    python -m jobs.generate launcher=local launcher.nprocs=2  # 2 local ranks (gloo on CPU)
    torchrun --nproc-per-node 8 -m jobs.generate strategy=tp tp_degree=4 model=flux_dev
    python -m jobs.generate launcher=slurm launcher.nodes=4 launcher.gpus_per_node=8 ...
"""

from __future__ import annotations

import logging
import os
import shlex
import sys

import hydra

from shardgen.cli import run_program
from shardgen.config.paths import CONF
from shardgen.config.schema import GenerateConfig
from shardgen.config.store import register_configs

register_configs()
log = logging.getLogger("shardgen")


def run(cfg: GenerateConfig):
    """Run or submit the job described by a composed config (tests call this directly)."""
    from shardgen.dataio.prompts import prompt_file_path
    from shardgen.dataio.resume.fingerprint import refuse_changed_settings
    from shardgen.dataio.rundir import RunDir, check_run_dir_text, check_run_root

    from shardgen.models.quiet import quiet_storage_clients

    quiet_storage_clients()
    _guess_prompt_field(cfg)
    # a run_dir shardgen may not write to, or a resume with other settings, is refused in a moment, before torch loads
    check_run_dir_text(cfg.run_dir)
    run_dir = RunDir.at(cfg.run_dir)
    if not check_run_root(run_dir.root) and not cfg.dry_run:  # an existing run (a dry run reports a refusal)
        refuse_changed_settings(cfg, run_dir, prompt_file_path(cfg.prompts.path))
    from shardgen.config.launchers import launcher_of
    from shardgen.config.validate import validate_config

    validate_config(cfg)
    if cfg.dry_run:  # the plan and what it would take, with no model loaded and nothing written
        from shardgen.run.dryrun import describe, dry_run

        report = dry_run(cfg)
        print(describe(report))
        return report
    return launcher_of(cfg).starter()(cfg)


def _guess_prompt_field(cfg: GenerateConfig) -> None:
    """``prompts.field`` left at its default on a file without that field: the one common caption column it has
    (``caption``, ``text``, ...) instead, said in one line; the resolved config, fingerprint and launches use it."""
    import logging

    from shardgen.config.schema import PromptsConfig
    from shardgen.dataio.prompts import prompt_file_path
    from shardgen.dataio.prompts.read import guess_prompt_field

    from omegaconf import OmegaConf

    default = PromptsConfig.field
    if OmegaConf.is_missing(cfg.prompts, "path") or cfg.prompts.path is None or cfg.prompts.field != default:
        return  # an unset path is validation's to refuse, in one line
    path = str(prompt_file_path(cfg.prompts.path))
    guess = guess_prompt_field(path, cfg.prompts.format, default)
    if guess is not None:
        cfg.prompts.field = guess
        logging.getLogger("shardgen").info("prompts.field=%s: %s has no %r field, and its %r is taken as the prompt "
                                           "(set prompts.field to choose another)", guess, path, default, guess)


def interrupted_message(run_dir: str, command: str, how: str = "interrupted") -> str:
    """What an interrupted launch tells (``how``: "interrupted" for Ctrl-C, "stopped by SIGTERM"): resumable once
    the run exists (its fingerprint written), otherwise that nothing was written (a new run interrupted while
    planning is removed again)."""
    from shardgen.dataio.rundir import RunDir

    run = RunDir.at(run_dir)
    if not run.files.exists(run.fingerprint_path):
        return (f"{how} before {run_dir} held a run: nothing was written. Run the command again to start:\n"
                f"  {command}")
    return f"{how}. {run_dir} is resumable: re-run the same command to continue where it stopped:\n  {command}"


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="generate")
def main(cfg: GenerateConfig) -> None:
    from shardgen.errors import is_user_error
    from shardgen.run.stopping import SIGTERM_EXIT, Terminated, stop_on_sigterm

    debug = os.environ.get("SHARDGEN_DEBUG", "") not in ("", "0")  # SHARDGEN_DEBUG=1: tracebacks always
    stop_on_sigterm()
    try:
        run(cfg)
    except KeyboardInterrupt as e:
        if debug:
            raise
        how = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        log.error("%s", interrupted_message(cfg.run_dir, shlex.join([sys.executable, "-m", "jobs.generate",
                                                                     *sys.argv[1:]]), how))
        sys.exit(SIGTERM_EXIT if isinstance(e, Terminated) else 130)
    except Exception as e:
        from shardgen.dataio.rundir.storage import storage_error

        e = storage_error(e) or e  # a full disk or a read-only file system is the user's to fix, wherever it hit
        if is_user_error(e) and not debug:  # a message for the user, not a traceback
            from parallel.world import echo_of_rank0
            from shardgen.tools.runfiles import escape_terminal

            if not echo_of_rank0(e):  # under torchrun, rank 0's refusal once, not once per rank
                log.error("%s", escape_terminal(str(e)))  # it may quote the run directory's files: shown, never obeyed
            sys.exit(2)
        raise


def refuse_unknown_overrides(argv: list[str]) -> None:
    """Exit with one line when an override names no key or group option (Hydra would add ``+key`` silently, and
    answer a wrong option with its search path), gives a key a value of the wrong type, or has no ``=`` (Hydra's
    merge and parse errors are five lines, exit status 1)."""
    from shardgen.config.overrides import check_overrides

    try:  # Hydra's own command-line parser (the overrides among its flags); a Hydra without it checks them itself
        from hydra._internal.utils import get_args_parser

        args, _ = get_args_parser().parse_known_args(argv)
    except (ImportError, AttributeError, SystemExit):
        return
    problem = check_overrides(list(args.overrides or ()))
    if getattr(args, "multirun", False):  # Hydra's sweeps write multirun/ folders of their own
        problem = ("--multirun: one command is one run (Hydra's sweep folders would be written outside run_dir); "
                   "run the command once per setting, each with its own run_dir")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def entry(argv: list[str] | None = None) -> None:
    """The command line: refused in one line where Hydra's override parser would fail obscurely or an override
    names no key or has a value its key cannot take, else ``main``."""
    from shardgen.config.cmdline import command_line_problem

    argv = sys.argv[1:] if argv is None else argv
    if problem := command_line_problem(argv):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    refuse_unknown_overrides(argv)
    main()


if __name__ == "__main__":
    run_program(entry, "jobs.generate")
