"""Every option of every config group composes; typos fail while composing, naming what is valid."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from tests.conftest import CONF, ROOT, compose_cfg

GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in CONF.iterdir() if g.is_dir()}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group, option):
    cfg = compose_cfg(f"{group}={option}")
    if group == "speed":  # a profile: it sets top-level keys (conf/speed/*.yaml is @package _global_), no node
        assert "speed" not in cfg and cfg.fp8 == (option == "fast")
        return
    node = cfg[group]
    if group == "prompts":
        assert node.format in ("txt", "jsonl", "csv", "tsv", "parquet", "auto")
    elif group == "signals":  # a multi-select group: signals=[phash,clip] sets signals.phash, signals.clip
        assert list(node) == [option]
    else:
        assert node.name == option
    # top-level sizes follow the model unless overridden
    assert (cfg.height, cfg.steps) == (cfg.model.height, cfg.model.steps)


def test_groups_present():
    assert {"model", "strategy", "launcher", "prompts"} <= set(GROUPS)
    assert {"tiny", "flux_dev", "flux2_dev", "qwen_image"} <= set(GROUPS["model"])
    assert {"dp", "tp", "cp_ulysses", "cp_ring", "cp_unified", "device_map", "auto"} <= set(GROUPS["strategy"])


def test_mission_command_line_composes_as_typed():
    cfg = compose_cfg("strategy=tp", "tp_degree=4")
    assert (cfg.strategy.name, cfg.tp_degree) == ("tp", 4)


def test_unknown_key_fails_while_composing():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("tp_degre=4")
    assert "tp_degre" in str(e.value.__cause__ or e.value)


def test_unknown_group_key_fails():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("model.foo=1")
    assert "foo" in str(e.value.__cause__ or e.value)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(MissingConfigException) as e:
        compose_cfg("strategy=tpp")
    msg = str(e.value)
    assert "strategy/tpp" in msg and "tp" in msg and "cp_ulysses" in msg


def test_wrong_type_fails():
    with pytest.raises(ConfigCompositionException):
        compose_cfg("batch_size=four")


# --- the top-level keys in groups (schema.GROUPS), each defined once, read through shardgen/pick.py ---

def test_every_top_level_key_is_in_exactly_one_group():
    import dataclasses
    from collections import Counter

    from shardgen.config.schema import GROUPS, GenerateConfig, NestedConfigs

    names = Counter(f.name for g in (*GROUPS, NestedConfigs) for f in dataclasses.fields(g))
    assert [n for n, c in names.items() if c > 1] == []  # inheritance would silently merge a key of two groups
    assert set(names) == {f.name for f in dataclasses.fields(GenerateConfig)}  # no key outside the groups


def test_each_groups_keys_stay_flat_on_the_command_line():
    from shardgen.config.schema import (CoordinationConfig, GenerationConfig, OutputConfig, ParallelDegrees,
                                        RunConfig, SpeedConfig, VideoConfig)
    from shardgen.pick import pick

    cfg = compose_cfg("model=tiny_video", "strategy=tp", "tp_degree=4", "compile=false", "video_crf=20", "lease_s=30",
                      "image_quality=80", "seed=7", "dry_run=true", "height=64")
    assert (pick(ParallelDegrees, cfg).tp_degree, pick(SpeedConfig, cfg).compile) == (4, False)
    assert (pick(VideoConfig, cfg).video_crf, pick(VideoConfig, cfg).num_frames) == (20, cfg.model.num_frames)
    assert (pick(CoordinationConfig, cfg).lease_s, pick(OutputConfig, cfg).image_quality) == (30.0, 80)
    assert (pick(GenerationConfig, cfg).seed, pick(GenerationConfig, cfg).height, pick(RunConfig, cfg).dry_run) \
        == (7, 64, True)


def test_pick_refuses_a_default_only_a_composed_config_resolves_and_an_unknown_field():
    from shardgen.config.schema import SpeedConfig, VideoConfig
    from shardgen.pick import pick

    assert pick(SpeedConfig, {"fp8": True}).fp8 and pick(SpeedConfig, {}).compile == "auto"  # the schema's default
    with pytest.raises(KeyError, match=r"VideoConfig.num_frames.*\$\{model.num_frames\}"):
        pick(VideoConfig, {})
    with pytest.raises(TypeError, match="SpeedConfig has no field fp16"):
        pick(SpeedConfig, {}, fp16=True)


class _Reads:
    """A composed config that records the top-level keys read from it (not those only probed with ``in``)."""

    def __init__(self, cfg):
        self._cfg, self.read = cfg, set()

    def __contains__(self, key):
        return key in self._cfg

    def __getitem__(self, key):
        self.read.add(key)
        return self._cfg[key]

    def get(self, key, default=None):
        self.read.add(key)
        return self._cfg.get(key, default)

    def __getattr__(self, key):
        self.read.add(key)
        return getattr(self._cfg, key)


def test_each_runtime_class_reads_only_its_groups_keys(tmp_path):
    import dataclasses

    from shardgen.config.schema import GenerationConfig, SpeedConfig, VideoConfig
    from shardgen.dataio.shards.video import VideoEncoder
    from shardgen.run.generation import GenSettings
    from shardgen.run.latent_ckpt import LatentCheckpoints
    from shardgen.speed.accel import AccelOptions

    def keys(*groups):
        return {f.name for g in groups for f in dataclasses.fields(g)}

    cfg = compose_cfg("model=tiny_video", f"run_dir={tmp_path}")
    # (what builds it, the keys it may read: its groups' and the nested groups or keys it derives a value from)
    cases = [(AccelOptions.from_cfg, keys(SpeedConfig) | {"device", "strategy"}),
             (VideoEncoder.from_cfg, keys(VideoConfig)),
             (LatentCheckpoints.from_cfg, keys(VideoConfig) | {"run_dir", "model", "strategy"}),
             (GenSettings.from_cfg, keys(GenerationConfig, VideoConfig, SpeedConfig) | {"run_dir", "model", "strategy"})]
    for build, allowed in cases:
        rec = _Reads(cfg)
        build(rec)
        assert rec.read - allowed == set(), build.__qualname__
    rec = _Reads(cfg)
    s = GenSettings.from_cfg(rec)
    assert {"height", "width", "steps", "guidance", "batch_size", "num_frames"} <= rec.read
    assert (s.height, s.num_frames, s.true_cfg_scale, s.model) == (cfg.height, cfg.num_frames,
                                                                    cfg.model.true_cfg_scale, cfg.model.name)


@pytest.mark.parametrize("override,line", [
    ("batchsize=4", "batchsize=4: no key 'batchsize' (did you mean batch_size?)"),
    ("+batchsize=4", "+batchsize=4: no key 'batchsize' (did you mean batch_size?)"),
    ("++batchsize=4", "++batchsize=4: no key 'batchsize' (did you mean batch_size?)"),
    ("+model.sourc=x", "+model.sourc=x: no key 'model.sourc' (did you mean model.source?)"),
    ("strategy=tpp", "strategy=tpp: no strategy option 'tpp' (did you mean tp?); the options are auto, cp_ring,"),
    ("model=flux", "model=flux: no model option 'flux' (did you mean flux_dev or flux2_dev?); the options are "),
    ("signals=[phash,wm]", "signals=[phash,wm]: no signals option 'wm'; the options are clip, phash, watermark"),
])
def test_a_misspelled_key_or_option_names_the_close_ones_even_when_added_with_plus(override, line):
    from shardgen.config.overrides import check_overrides

    message = check_overrides(["steps=2", override])
    assert message.startswith(line) and "\n" not in message


def test_known_keys_options_and_free_dicts_pass_the_check():
    from shardgen.config.overrides import check_overrides

    assert check_overrides(["batch_size=4", "model=flux_dev", "strategy=tp", "tp_degree=2", "launcher=slurm", "launcher.nodes=2",
                            "+strategy.max_memory.0=70GiB", "signals=[phash,clip]", "hydra.run.dir=.",
                            "hydra/job_logging=disabled",
                            "~model.revision", "prompts.limit=3"]) is None


@pytest.mark.parametrize("override", [
    "hydra.run.dir=/tmp/elsewhere", "hydra.output_subdir=.hydra", "hydra.sweep.dir=/tmp/sweeps", "hydra.job.chdir=true",
    "hydra/job_logging=default", "+hydra.job_logging.handlers.file.filename=/tmp/x.log", "hydra.mode=MULTIRUN",
    "hydra.runtime.output_dir=/tmp/out", "hydra=other"])
def test_hydra_settings_that_could_write_outside_the_run_are_refused_in_one_line(override):
    from shardgen.config.overrides import check_overrides

    message = check_overrides(["steps=2", override])
    assert message is not None and message.startswith(f"{override}: ") and "\n" not in message


@pytest.mark.parametrize("args", [["hydra.run.dir={out}"], ["hydra.output_subdir={out}"], ["--multirun", "steps=1,2"],
                                  ["hydra/job_logging=default"]])
def test_the_command_line_refuses_hydra_output_before_anything_is_written(tmp_path, args):
    import subprocess
    import sys

    out = tmp_path / "hydra-out"
    cmd = [sys.executable, "-m", "jobs.generate", *(a.format(out=out) for a in args), f"run_dir={tmp_path / 'r'}",
           "height=16", "width=16", "steps=1", "progress=false"]
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == [], "Hydra or the run wrote something"


def test_the_command_line_refuses_plus_batchsize_in_one_line_before_hydra(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    p = subprocess.run([sys.executable, "-m", "jobs.generate", "+batchsize=4", f"run_dir={tmp_path / 'r'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and not (tmp_path / "r").exists()
    assert p.stderr.strip() == ("error: +batchsize=4: no key 'batchsize' (did you mean batch_size?); "
                                "python -m jobs.generate --help lists every key")


def test_docs_config_md_is_the_reference_generated_from_the_schema():
    from shardgen.config.help import markdown_reference
    from tests.conftest import ROOT

    current = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert current == markdown_reference(), "regenerate it: python -m shardgen.config.help > docs/config.md"


@pytest.mark.parametrize("override", ["guidance=inf", "guidance=nan", "guidance=-inf", "model.true_cfg_scale=nan",
                                      "height=100000", "width=8208"])
def test_a_number_no_run_can_use_is_refused_while_validating(override):
    from shardgen.config.validate import ConfigError, validate_config

    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        validate_config(compose_cfg(override))


@pytest.mark.parametrize("arg,says", [("run_dir=/tmp/é", "quote the value"), ("prompts.path=x/\udcc3\udca9", "UTF-8 locale")])
def test_what_hydras_parser_cannot_take_is_one_line_naming_the_fix(arg, says, capsys):
    from jobs import generate

    with pytest.raises(SystemExit) as e:
        generate.entry([arg, "dry_run=true"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1


def test_a_quoted_non_ascii_value_composes():
    from shardgen.config.cmdline import command_line_problem

    arg = "run_dir='/tmp/é'"
    assert command_line_problem([arg]) is None and compose_cfg(arg).run_dir == "/tmp/é"


@pytest.mark.parametrize("arg,line", [
    ("strategy=tpp", "error: strategy=tpp: no strategy option 'tpp' (did you mean tp?); the options are auto, cp_ring, "
                     "cp_ulysses, cp_unified, device_map, dp, fsdp, tp (conf/strategy/)"),
    ("model=flux", "error: model=flux: no model option 'flux' (did you mean flux_dev or flux2_dev?); the options are "
                   + ", ".join(sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))) + " (conf/model/)"),
    ("batchsize=4", "error: batchsize=4: no key 'batchsize' (did you mean batch_size?); python -m jobs.generate "
                    "--help lists every key"),
])
def test_a_wrong_group_option_or_key_on_the_command_line_is_one_line_and_nothing_of_hydras(arg, line, capfd,
                                                                                         tmp_path):
    from jobs import generate

    with pytest.raises(SystemExit) as e:
        generate.entry([arg, f"run_dir={tmp_path / 'r'}"])
    out = capfd.readouterr()
    assert e.value.code == 2 and out.out == "" and out.err == line + "\n" and not (tmp_path / "r").exists()


@pytest.mark.parametrize("override,line", [
    ("batch_size=1.5", "batch_size=1.5: batch_size takes an integer"),
    ("height=abc", "height=abc: height takes an integer"),
    ("steps=true", "steps=true: steps takes an integer"),
    ("seed=1e3", "seed=1e3: seed takes an integer (e.g. seed=1000)"),
    ("guidance=abc", "guidance=abc: guidance takes a number"),
    ("progress=maybe", "progress=maybe: progress takes true or false"),
    ("prompts.limit=abc", "prompts.limit=abc: prompts.limit takes an integer or null"),
    ("model.source=null", "model.source=null: model.source takes a string, not null"),
    ("bogus", "bogus: not KEY=VALUE, and no key 'bogus'; python -m jobs.generate --help lists every key"),
    ("batch_size", "batch_size: no value: write batch_size=VALUE"),
])
def test_a_value_hydra_cannot_convert_or_a_word_without_equals_is_one_line_naming_the_type(override, line):
    from shardgen.config.overrides import check_overrides

    assert check_overrides(["steps=2", override]) == line


@pytest.mark.parametrize("override", [
    "seed=0", "height=1024", "guidance=3.5", "guidance=4", "compile=auto", "compile=true", "prompts.limit=null",
    "model.revision=null", "signals=[phash]", "height=${model.width}", "seed=${oc.env:SEED,0}", "seed='5'",
    "progress=0", "stall_timeout_s=null", "prompts.row_settings=[guidance]", "model.loras=[{path: a.safetensors}]",
    "+strategy.max_memory.0=70GiB", "~model.revision", "seed=1,2", "seed=-1"])
def test_values_hydra_takes_pass_the_type_check(override):
    from shardgen.config.overrides import check_overrides

    assert check_overrides(["model=flux_dev", "strategy=tp", override]) is None


def test_a_wrong_type_on_the_command_line_exits_2_in_one_line_before_hydra(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "jobs.generate", f"run_dir={tmp_path / 'r'}", "batch_size=1.5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and not (tmp_path / "r").exists()
    assert p.stderr == "error: batch_size=1.5: batch_size takes an integer\n"


@pytest.mark.parametrize("override,says", [
    ("seed=-1", "seed=-1 is out of range: write an integer from 0 to 2**63-1"),
    (f"seed={2**63}", f"seed={2**63} is out of range: write an integer from 0 to 2**63-1"),
    ("guidance=-1", "guidance=-1 is out of range: write a number from 0 up"),
    ("heartbeat_s=0", "heartbeat_s=0.0: use a positive number of seconds below lease_s=120.0"),
    ("lease_s=0", "lease_s=0.0: use a positive number of seconds"),
])
def test_a_run_seed_guidance_or_heartbeat_out_of_range_is_refused_naming_the_range(override, says):
    from shardgen.config.validate import ConfigError, validate_config

    with pytest.raises(ConfigError) as e:
        validate_config(compose_cfg(override))
    assert str(e.value).startswith(says)


def test_the_edges_of_the_seed_and_guidance_ranges_validate():
    from shardgen.config.validate import validate_config

    validate_config(compose_cfg(f"seed={2**63 - 1}", "guidance=0", "heartbeat_s=0.5", "lease_s=1"))


@pytest.mark.parametrize("override,says", [
    ("model.strength=nan", "model.strength=nan: not a finite number; give a number (e.g. model.strength=0.6)"),
    ("model.loras=[{path: a.safetensors, scale: nan}]",
     "model.loras[0].scale=nan: not a finite number; give a number (e.g. model.loras[0].scale=0.8)"),
    ("model.loras=[{path: a.safetensors, scale: -inf}]",
     "model.loras[0].scale=-inf: not a finite number; give a number (e.g. model.loras[0].scale=0.8)"),
    ("guidance=nan", "guidance=nan: not a finite number; give a number (e.g. guidance=3.5)"),
    ("lease_s=inf", "lease_s=inf: not a finite number; give a number (e.g. lease_s=120)"),
])
def test_a_number_that_is_not_finite_is_refused_with_an_example_in_its_range(override, says):
    from shardgen.config.validate import ConfigError, validate_config

    with pytest.raises(ConfigError) as e:
        validate_config(compose_cfg(override))
    assert str(e.value) == says


def test_help_lists_the_launchers_one_can_choose_and_no_schema_entries():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "jobs.generate", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    groups = out.stdout.split("== Config groups (group=option) ==\n")[1].split("\n\n")[0].splitlines()
    assert "launcher: local, none, ray, slurm" in groups and "base_" not in out.stdout
    assert any(line.startswith("strategy: auto, ") for line in groups)


@pytest.mark.parametrize("scale", ["true", "[1]", "'0.8'"])
def test_a_lora_scale_that_is_no_number_is_one_line_before_hydra(scale):
    from shardgen.config.overrides import check_overrides

    override = f"model.loras=[{{path: style.safetensors, scale: {scale}}}]"
    message = check_overrides([override])
    assert message is not None and "\n" not in message
    assert message.startswith(f"{override}: model.loras[0].scale takes a number, not ")
    assert check_overrides(["model.loras=[{path: style.safetensors, scale: 0.8}]"]) is None
    assert "has no field 'scal' (did you mean scale?)" in check_overrides(["model.loras=[{path: a, scal: 1}]"])
