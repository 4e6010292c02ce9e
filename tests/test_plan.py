"""The plan stores where each shard starts in the prompt file, not the rows: reading a shard back
gives exactly the rows the prompt reader gives, in every format; a damaged plan is named with its fix."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardgen.dataio.prompts.plan import PlanError, build_plan, load_plan, sample_seed
from shardgen.dataio.prompts.read import PromptFileError, PromptSource, read_prompts
from shardgen.dataio.rundir.layout import RunDir

TXT = ("\ufeffa cat\r\nsecond line\n\n   \nna\xefve caf\xe9\n".encode("utf-8") + b"bad \xff byte\n"
       + "\u3000\n".encode("utf-8") + b"last line without newline")
JSONL = b'{"prompt": "a", "seed": 3, "tag": "x"}\n{"prompt": 5}\nnot json\n{"prompt": "b", "tag": "y"}\n' \
        b'{"prompt": "c"}\n'
CSV = b'prompt,seed,tag\n"a, multi\nline",7,x\nb,,y\n"broken,1,z\nc,2,w\n'
TSV = b'prompt\ttag\n"quoted" stays\tx\nonly one\n\tz\nd\tw\n'


def _expected(path, fmt, limit=None, **kw):
    rows = [r for r in read_prompts(str(path), format=fmt, on_bad_row="skip", **kw)
            if limit is None or r.index < limit]
    return [(r.index, r.line, r.prompt, sample_seed(7, r.index, r.seed), r.extra, r.reject) for r in rows]


def _planned(run, path, fmt, per_shard, limit=None):
    plan = build_plan(run, PromptSource(str(path), fmt, on_bad_row="skip", limit=limit),
                      samples_per_shard=per_shard, run_seed=7)
    got = [(r.index, r.line, r.prompt, r.seed, r.extra, r.reject) for s in range(plan.num_shards)
           for r in plan.rows(s)]
    return plan, got


@pytest.mark.parametrize("fmt,data", [("txt", TXT), ("jsonl", JSONL), ("csv", CSV), ("tsv", TSV)])
@pytest.mark.parametrize("per_shard", [1, 2, 3, 100])
def test_rows_read_back_equal_the_readers(tmp_path, fmt, data, per_shard):
    path = tmp_path / f"p.{fmt}"
    path.write_bytes(data)
    plan, got = _planned(RunDir(tmp_path / "run"), path, fmt, per_shard)
    want = _expected(path, fmt)
    assert got == want
    assert plan.num_rows == len(want) and plan.num_rejects == sum(w[-1] is not None for w in want)
    assert [len(plan.rows(s)) for s in range(plan.num_shards)] == [len(plan.shard_range(s))
                                                                    for s in range(plan.num_shards)]


def test_limit_and_a_big_txt_across_planning_blocks(tmp_path, monkeypatch):
    import shardgen.dataio.prompts.planscan as scan_mod
    import shardgen.dataio.prompts.txt as txt_mod

    for mod in (scan_mod, txt_mod):  # txt's scan, and the line offsets of the limit's stop
        monkeypatch.setattr(mod, "_BLOCK", 64)  # many blocks, lines cut at block edges
    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt number {i}\n" if i % 37 else "\n" for i in range(1000)), encoding="utf-8")
    for limit in (None, 555):
        plan, got = _planned(RunDir(tmp_path / f"run{limit}"), path, "txt", 64, limit)
        assert got == _expected(path, "txt", limit)
        assert plan.num_rejects == len(range(0, limit or 1000, 37))


def test_parquet_rows_across_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    prompts = [f"p{i}" if i % 5 else "" for i in range(50)]
    pq.write_table(pa.table({"prompt": prompts, "n": list(range(50))}), path, row_group_size=7)
    for per_shard in (1, 4, 9, 60):
        _, got = _planned(RunDir(tmp_path / f"run{per_shard}"), path, "parquet", per_shard)
        assert got == _expected(path, "parquet")


def test_txt_fast_scan_equals_the_reader_on_random_files(tmp_path, monkeypatch):
    """The numpy block scan (first-byte test, newline search) gives the reader's rows and rejects on random
    mixes of blank, whitespace, CR, BOM, NUL, non-UTF-8, CJK and long lines, cut at random block edges."""
    import random

    import shardgen.dataio.prompts.txt as scan_mod

    pieces = [b"a cat", b" lead", b"", b"   ", b"\t", b"\r", b"caf\xc3\xa9", "\u4e00\u53ea".encode(), b"\xff bad",
              b"\xef\xbb\xbf", "\u3000".encode(), b"x" * 50, b"\x00"]
    rng = random.Random(1)
    for trial in range(60):
        lines = [b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 30))]
        data = b"\n".join(lines) + (b"\n" if trial % 2 else b"")
        if data in (b"", b"\xef\xbb\xbf"):
            continue  # no rows (a file of only a BOM: the reader says "no rows", the plan one reject)
        path = tmp_path / f"p{trial}.txt"
        path.write_bytes(data)
        monkeypatch.setattr(scan_mod, "_BLOCK", rng.choice([1, 7, 64, 16 << 20]))
        _, got = _planned(RunDir(tmp_path / f"run{trial}"), path, "txt", rng.choice([1, 3, 100]))
        assert got == _expected(path, "txt"), data


def test_rows_of_a_large_file_are_estimated_from_samples(tmp_path, monkeypatch):
    import shardgen.dataio.prompts.plan as plan_mod
    from shardgen.dataio.prompts.plan import estimate_rows

    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt {i} " + "x" * (i % 50) + "\n" for i in range(100_000)), encoding="utf-8")
    assert estimate_rows(PromptSource(str(path), "txt")) == 100_000  # small: counted
    monkeypatch.setattr(plan_mod, "_EXACT_COUNT_BYTES", 1 << 20)
    assert abs(estimate_rows(PromptSource(str(path), "txt")) - 100_000) < 5_000
    assert estimate_rows(PromptSource(str(path), "txt", limit=10)) == 10


def test_plan_does_not_copy_the_prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("".join(f"a long prompt about thing {i} " * 4 + "\n" for i in range(20000)), encoding="utf-8")
    run = RunDir(tmp_path / "run")
    build_plan(run, PromptSource(str(path), "txt"), samples_per_shard=1000, run_seed=1)
    size = sum(p.stat().st_size for p in run.plan_dir.iterdir())
    assert size < 4096 < path.stat().st_size // 100


def test_bad_txt_line_is_named_with_path_and_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"ok\nok\n  \nok\n")
    with pytest.raises(PromptFileError, match=r"p.txt:3: the prompt is only whitespace"):
        build_plan(RunDir(tmp_path / "run"), PromptSource(str(path), "txt"), samples_per_shard=2, run_seed=1)
    assert not (tmp_path / "run" / "plan").exists()
    assert not list((tmp_path / "run").glob(".plan-*"))


def test_a_killed_planners_temp_dir_is_removed_by_the_next_launch(tmp_path):
    from shardgen.dataio.prompts.plan import _host

    path = tmp_path / "p.txt"
    path.write_text("a\nb\n")
    run = RunDir(tmp_path / "run")
    (tmp_path / "run").mkdir()
    dead = tmp_path / "run" / f".plan-{_host()}-999999999-abc"  # no such pid
    dead.mkdir()
    alive = tmp_path / "run" / f".plan-{_host()}-{os.getpid()}-def"  # a live planner's: kept while planning
    alive.mkdir()
    assert load_plan(run) is None
    assert not dead.exists() and alive.exists()
    build_plan(run, PromptSource(str(path), "txt"), samples_per_shard=1, run_seed=1)
    assert load_plan(run) is not None
    assert alive.exists()  # a live planner's dir stays even once a plan exists: it is still writing into it


def test_a_job_that_loses_the_planning_race_adopts_the_winners_plan(tmp_path, monkeypatch):
    """Two jobs plan one fresh run at once: the one whose rename loses is still writing into its own temp dir
    while the winner reads its plan back; neither fails, and both use one plan."""
    import shardgen.dataio.prompts.txt as plan_mod  # the txt format plans with its scan_txt

    path = tmp_path / "p.txt"
    path.write_text("a\nb\nc\n")
    run = RunDir(tmp_path / "run")
    real_scan = plan_mod.scan_txt

    def scan_while_another_job_wins(source, *a):
        out = real_scan(source, *a)
        monkeypatch.setattr(plan_mod, "scan_txt", real_scan)
        build_plan(run, source, samples_per_shard=2, run_seed=1)  # the other job plans and reads its plan back
        return out

    monkeypatch.setattr(plan_mod, "scan_txt", scan_while_another_job_wins)
    plan = build_plan(run, PromptSource(str(path), "txt"), samples_per_shard=2, run_seed=1)
    assert plan.num_rows == 3 and plan.num_shards == 2
    assert not list((tmp_path / "run").glob(".plan-*"))


@pytest.mark.parametrize("damage,needle", [
    (lambda p: (p / "plan.json").write_text("{garbage"), "plan.json: unreadable"),
    (lambda p: (p / "plan.json").unlink(), "plan.json: missing"),
    (lambda p: (p / "starts.npy").unlink(), "starts.npy: missing"),
    (lambda p: (p / "starts.npy").write_bytes(b"junk"), "starts.npy: unreadable"),
    (lambda p: np.save(p / "starts.npy", np.load(p / "starts.npy") + 1), "starts.npy: does not match the checksum"),
])
def test_a_damaged_plan_names_the_file_and_the_fix(tmp_path, damage, needle):
    path = tmp_path / "p.txt"
    path.write_text("a\nb\nc\n")
    run = RunDir(tmp_path / "run")
    build_plan(run, PromptSource(str(path), "txt"), samples_per_shard=2, run_seed=1)
    damage(run.plan_dir)
    with pytest.raises(PlanError, match=needle) as e:
        load_plan(run)
    assert f"delete {run.plan_dir}" in str(e.value)


def test_a_prompt_file_changed_under_the_plan_is_refused(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a\nb\nc\n")
    run = RunDir(tmp_path / "run")
    plan = build_plan(run, PromptSource(str(path), "txt"), samples_per_shard=2, run_seed=1)
    path.write_text("a\nb\nc\nd\n")  # appended to: the planned rows are still there (a run grows this way)
    assert [r.prompt for r in plan.rows(1)] == ["c"]
    path.write_text("a\nb\n")
    with pytest.raises(PromptFileError, match="changed since the run was planned"):
        plan.rows(1)


def test_shard_size_is_chosen_from_the_image_size_and_the_ranks():
    from shardgen.dataio.prompts.plan import idle_warning
    from shardgen.dataio.shards.sizing import choose_samples_per_shard

    big = dict(width=1024, height=1024, image_format="png", batch_size=4)
    n, why = choose_samples_per_shard(1_000_000, replicas=8, **big)
    assert n == 188 and "1.57 MB per 1024x1024 png sample" in why  # ~300 MB shards, 47 batches of 4
    n, _ = choose_samples_per_shard(24, replicas=1, **big)
    assert n == 4  # 24 prompts: 6 by spread, rounded down to whole batches (no short batch in any shard)
    assert choose_samples_per_shard(30, replicas=1, **dict(big, batch_size=3))[0] == 3  # 2 by spread: a batch
    assert choose_samples_per_shard(300, replicas=1, **dict(big, batch_size=3))[0] == 18  # 19 by spread, rounded
    n, _ = choose_samples_per_shard(64, replicas=2, width=64, height=64, image_format="png", batch_size=4)
    assert n == 4  # 64 prompts on 2 replicas: 16 shards, 8 per replica, not one shard and an idle rank
    n, _ = choose_samples_per_shard(20_000, replicas=8, width=64, height=64, image_format="png", batch_size=4)
    assert n == 156  # 129 shards: ~16 per replica, so the tail (about one shard) is ~1/16 of the run
    assert choose_samples_per_shard(3, replicas=1, width=64, height=64, image_format="png", batch_size=4)[0] == 4
    assert idle_warning(1, 2, 1000).startswith("2 replicas but only 1 shard(s) of 1000: 1 replica(s) will have")
    assert idle_warning(8, 2, 8) is None


def test_the_default_run_logs_its_shard_size_and_explicit_sizes_stay(tmp_path, caplog):
    import logging

    from jobs.generate import run
    from tests.conftest import compose_cfg, write_lines

    f = write_lines(tmp_path / "p.txt", [f"prompt {i}" for i in range(20)])
    fast = ("height=16", "width=16", "steps=1", "progress=false", f"prompts.path={f}")
    with caplog.at_level(logging.INFO, logger="shardgen"):
        run(compose_cfg(f"run_dir={tmp_path / 'auto'}", *fast))
    assert "samples_per_shard=4 (chosen:" in caplog.text  # 5 by spread, rounded down to whole batches of 4
    assert load_plan(RunDir(tmp_path / "auto")).num_shards == 5
    run(compose_cfg(f"run_dir={tmp_path / 'explicit'}", "samples_per_shard=7", *fast))
    assert load_plan(RunDir(tmp_path / "explicit")).samples_per_shard == 7


# seeds (from the architecture step's unit tests of the pure core)

def test_sample_seed_is_pinned():
    """Changing the hash would change every image of a resumed run: these values are the contract."""
    assert [sample_seed(0, 0), sample_seed(0, 1), sample_seed(7, 123)] == [
        7070836379803831727, 1227844342346046657, 7660209823117301031]


def test_a_row_seed_wins_and_every_seed_fits_a_torch_generator():
    assert sample_seed(5, 3, row_seed=42) == 42
    seeds = [sample_seed(s, i) for s in (0, 1, 2**40) for i in range(1000)]
    assert all(0 <= x < 2**63 for x in seeds)


def test_every_run_seed_gives_its_own_noise():
    """Seeds that differ only above bit 30 (1, 2**30 + 1, 2**32 + 1, 2**62 + 1) are different runs."""
    seeds = [1, 2**30 + 1, 2**32 + 1, 2**40 + 1, 2**62 + 1, 2**63 - 1]
    per_run = [{sample_seed(s, i) for i in range(1000)} for s in seeds]
    assert sum(map(len, per_run)) == len(set().union(*per_run)) == 1000 * len(seeds)


def test_neighbouring_run_seeds_share_no_noise():
    """run_seed + index would give run 1's row 0 the seed of run 0's row 1; the hash does not."""
    run0 = {sample_seed(0, i) for i in range(5000)}
    run1 = {sample_seed(1, i) for i in range(5000)}
    assert len(run0) == 5000 and not run0 & run1


def test_plan_replicas_sizes_the_shards_for_every_launch_that_will_join_the_run(tmp_path):
    """One launch plans for 100 one-GPU jobs: ~16 shards each (a short tail), not 16 shards for the run; the
    choice is the planner's, the value checked like every key (a clear error before any work)."""
    from shardgen.config.validate import ConfigError, validate_config
    from shardgen.run.dryrun import dry_run
    from tests.conftest import compose_cfg

    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt {i}\n" for i in range(8_000)))
    args = ("model=tiny", f"run_dir={tmp_path / 'run'}", f"prompts.path={path}", "dry_run=true", "device=cpu",
            "batch_size=4", "height=64", "width=64")
    alone, joined = (dry_run(compose_cfg(*args, *extra)) for extra in ((), ("plan_replicas=100",)))
    assert (alone.samples_per_shard, alone.shards) == (500, 16)  # 16 shards for one replica
    assert joined.samples_per_shard == 4 and joined.shards == 2_000  # 8,000 / (100 x 16) = 5, whole batches
    with pytest.raises(ConfigError, match=r"plan_replicas=0: use 1 or more"):
        validate_config(compose_cfg(*args, "plan_replicas=0"))


def test_a_dry_run_plans_as_the_launch_does_tokenizing_only_where_planning_counts_tokens(tmp_path, monkeypatch):
    """on_truncation=warn (the default): no prompt is tokenized while planning, in a dry run as in the launch
    (tokenizing every row of a 5M-line file takes minutes; planning it alone, seconds)."""
    from shardgen.dataio.prompts.truncation import TruncationCheck
    from shardgen.run.dryrun import describe, dry_run
    from tests.conftest import compose_cfg

    path = tmp_path / "p.txt"
    path.write_text("".join(f"prompt {i}: {'a long description of a scene ' * 4}\n" for i in range(2_000)))
    tokenized = []
    real = TruncationCheck.flush
    monkeypatch.setattr(TruncationCheck, "flush", lambda self: tokenized.append(len(self._pending)) or real(self))
    args = ("model=flux_dev", f"run_dir={tmp_path / 'run'}", f"prompts.path={path}", "dry_run=true", "progress=false")
    d = dry_run(compose_cfg(*args))
    assert d.prompts == 2_000 and not tokenized
    assert "  size      ~3.1 GB of tars" in describe(d)  # 2,000 x ~1.57 MB png samples, not "~3145.7 MB"
    dry_run(compose_cfg(*args, "prompts.on_truncation=skip"))  # a launch skipping long prompts counts them: so does this
    assert tokenized


def test_sizes_are_printed_in_a_unit_that_keeps_a_short_number():
    from shardgen.config.sizes import format_bytes

    assert [format_bytes(n) for n in (512, 1.6e6, 122_880e6, 7.9e12, 250e9)] == \
        ["512 B", "1.6 MB", "123 GB", "7.9 TB", "250 GB"]


def test_a_dry_run_of_a_big_prompt_file_loads_no_tokenizer_and_takes_seconds(tmp_path, monkeypatch):
    """dry_run=true on a file of 300k lines (5M is the same scan, ~10 s): planned, nothing tokenized or loaded."""
    import time

    import transformers

    from shardgen.run.dryrun import describe, dry_run
    from tests.conftest import compose_cfg

    path = tmp_path / "big.txt"
    with path.open("w") as f:
        f.writelines(f"prompt number {i}: a photo of a cat on a mat\n" for i in range(300_000))

    loaded = []  # recorded, not raised: the planner reads tokenizers under a broad except (a hub id without files)
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: loaded.append(a) or real(*a, **k))
    t0 = time.perf_counter()
    d = dry_run(compose_cfg(f"run_dir={tmp_path / 'run'}", f"prompts.path={path}", "dry_run=true", "progress=false"))
    took = time.perf_counter() - t0
    assert d.prompts == 300_000 and "no model loaded, nothing written" in describe(d)
    assert not (tmp_path / "run").exists() and loaded == []
    assert took < 30, f"{took:.1f} s"  # measured ~1 s on 2 shared cores; tokenizing every row would take minutes


def test_a_dry_run_of_a_new_run_estimates_its_time_from_a_rate_recorded_for_its_settings(tmp_path, monkeypatch,
                                                                                        capsys):
    """Another run with the same model, size, steps, device, strategy and lossy settings left its rate: a dry run of
    a new run_dir gives a time from it, scaled by the replicas; other settings have none recorded."""
    from jobs.generate import run
    from shardgen.run.dryrun import describe, dry_run
    from tests.conftest import compose_cfg

    monkeypatch.setattr("shardgen.run.rates.rates_path", lambda: tmp_path / "rates.json")  # none recorded yet
    size = ("height=48", "width=80", "steps=1", "progress=false")
    new = ("dry_run=true", f"run_dir={tmp_path / 'new'}", *size)
    assert "time      not measured yet" in describe(dry_run(compose_cfg(*new)))
    assert run(compose_cfg(f"run_dir={tmp_path / 'first'}", "prompts.limit=8", *size)).ok == 8
    d = dry_run(compose_cfg(*new))
    line = next(ln for ln in describe(d).splitlines() if ln.startswith("  time"))
    assert d.expected_s > 0 and "for the 64 samples left, at the rate recorded for this model" in line
    assert str(tmp_path / "first") in line
    two = dry_run(compose_cfg(*new, "launcher=local", "launcher.nprocs=2"))
    assert two.rate == pytest.approx(2 * d.rate) and "x 2 replica(s)" in describe(two)
    assert "not measured yet" in describe(dry_run(compose_cfg(*new[:-1], "steps=2")))
    # a lossy setting runs at its own rate: an fp8 run is not estimated at the bf16 run's, nor records over it
    assert "not measured yet" in describe(dry_run(compose_cfg(*new, "fp8=true")))
    assert run(compose_cfg(f"run_dir={tmp_path / 'fp8'}", "prompts.limit=8", *size, "fp8=true")).ok == 8
    assert str(tmp_path / "fp8") in describe(dry_run(compose_cfg(*new, "fp8=true")))
    assert str(tmp_path / "first") in describe(dry_run(compose_cfg(*new)))
