"""Seeded fault injection into a tiny run directory: every damaged run ends verified and identical
to an uninterrupted one, or in a clear refusal naming a file; never a traceback, never a mixed run."""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest

from jobs.generate import run
from shardgen.dataio.prompts.plan import load_plan
from shardgen.dataio.resume.repair import load_plan_checked
from shardgen.dataio.rundir.layout import RunDir
from shardgen.tools.verify import read_shard_members, repair_run, verify_run
from shardgen.errors import UserError
from tests.conftest import compose_cfg, write_lines
from tests.test_integrity import make_partial

CASES = int(os.environ.get("FAULT_CASES", 220))
SEED = 11
ARGS = ("height=16", "width=16", "steps=1", "progress=false", "samples_per_shard=2", "batch_size=2",
        "lease_s=2", "heartbeat_s=0.5")  # a claim damaged just now looks alive: it expires within 2 s
OPS = ("flip", "truncate", "delete", "symlink", "empty", "garbage")


def content(run_dir: Path) -> dict:
    out = {}
    for tar in sorted((run_dir / "shards").glob("*.tar")):
        if tar.is_symlink():
            continue
        try:
            members = read_shard_members(tar)
        except Exception:
            continue  # a damaged tar is judged by verify, not here
        for key, mem in members.items():
            meta = json.loads(mem["json"])
            meta.pop("gen_s", None)
            out[key] = (mem.get("png"), mem["txt"], meta)
    return out


def damage(rng: random.Random, root: Path, decoy: Path) -> str:
    """Damage one random file of the run directory; what was done."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    path = rng.choice(files)
    op = rng.choice(OPS)
    damage_file(path, op, rng, decoy)
    return f"{op} {path.relative_to(root)}"


# JSON of the wrong shape: odd lines in a log, a state file that is a list, numbers out of range
ODD = b'[1]\n{"t": "x", "replica": {}, "samples": null, "wall_s": "s", "world_size": [], "shard": -1}\n{}\n"s"\n1e999\n'


def damage_file(path: Path, op: str, rng: random.Random, decoy: Path) -> None:
    """Damage one file in one way of OPS (or "odd": JSON of the wrong shape, "fifo": a FIFO in its place); a
    "symlink" points at ``decoy``."""
    data = path.read_bytes()
    if op == "flip" and data:
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(b))
    elif op == "truncate":
        os.truncate(path, rng.randrange(len(data) + 1))
    elif op == "delete":
        path.unlink()
    elif op == "symlink":
        path.unlink()
        path.symlink_to(decoy)
    elif op == "empty":
        path.write_bytes(b"")
    elif op == "odd":
        path.write_bytes(ODD)
    elif op == "fifo":  # opened for reading, it blocks until someone writes into it
        path.unlink()
        os.mkfifo(path)
    else:
        path.write_bytes(rng.randbytes(rng.randint(1, 64)))


@pytest.fixture()
def fast_model(monkeypatch):
    """The model is not under test here: it is loaded once, and each sample is generated once and then
    served from memory, keyed by everything that determines its pixels (so a mixed run would still show)."""
    import shardgen.run.runner as runner
    import shardgen.run.shardrun as shardrun

    real_apply, real_generate, pipes, made = runner.apply_strategy, shardrun.generate_batch, [], {}

    def apply_once(*args, **kwargs):
        if not pipes:
            pipes.append(real_apply(*args, **kwargs))
        return pipes[0]

    def generate_memo(pipe, settings, rows, *args):
        def key(r):
            return (r.index, r.prompt, r.seed, settings.height, settings.width, settings.steps, settings.model,
                    settings.guidance, settings.true_cfg_scale)

        todo = [r for r in rows if key(r) not in made]
        for r, smp in zip(todo, real_generate(pipe, settings, todo, *args) if todo else []):
            made[key(r)] = smp
        return [copy.copy(made[key(r)]) for r in rows]

    monkeypatch.setattr(runner, "apply_strategy", apply_once)
    monkeypatch.setattr(shardrun, "generate_batch", generate_memo)


def generate(cfg, run_dir: Path):
    """One launch; None when it refused with a message that names a file of the run directory."""
    cfg = copy.deepcopy(cfg)
    cfg.run_dir = str(run_dir)
    try:
        return run(cfg)
    except UserError as e:
        assert str(run_dir) in str(e), f"the refusal names no file: {e}"
        return None


@pytest.mark.slow
def test_fault_injection(tmp_path, fast_model, capsys):
    logging.getLogger("shardgen").setLevel(logging.CRITICAL)  # hundreds of repairs: keep the log short
    prompts = write_lines(tmp_path / "p.txt", [f"prompt {i}" for i in range(6)])
    cfg = compose_cfg(f"prompts.path={prompts}", *ARGS)
    finished = tmp_path / "finished"
    assert generate(cfg, finished).complete
    want = content(finished)
    partial = tmp_path / "partial"
    shutil.copytree(finished, partial, symlinks=True)
    make_partial(partial, 2, 1)
    for name in ("000001.stats.json", "000001.tar"):
        (partial / "shards" / name).unlink()
    decoy = tmp_path / "decoy"
    rng = random.Random(SEED)
    outcomes = {"identical": 0, "refused": 0, "repaired by verify --repair": 0}
    for case in range(CASES):
        decoy.write_bytes(b"decoy")
        d = tmp_path / f"case{case}"
        shutil.copytree(rng.choice((finished, partial)), d, symlinks=True)
        what = damage(rng, d, decoy)
        t0 = time.perf_counter()
        try:
            outcomes[_one_case(cfg, d, want)] += 1
        except AssertionError as e:
            raise AssertionError(f"case {case} ({what}): {e}") from None
        assert decoy.read_bytes() == b"decoy", f"case {case} ({what}) wrote through a symlink"
        shutil.rmtree(d)
        capsys.readouterr()  # the launches' summary lines
        if os.environ.get("FAULT_TIMES"):
            print(f"case {case} {what}: {time.perf_counter() - t0:.2f} s", file=sys.__stderr__)
    print(outcomes)
    assert outcomes["identical"] > CASES // 2


def _one_case(cfg, d: Path, want: dict) -> str:
    r = generate(cfg, d)
    if r is None:
        assert _subset(content(d), want), "refused, but what is committed is mixed"
        return "refused"
    rep = verify_run(load_plan_checked(RunDir(d)))
    if rep.ok:
        assert content(d) == want, "verified but not identical"
        return "identical"
    assert rep.bad_shards, f"verify failed with nothing to repair: {rep.defects}"
    repair_run(load_plan(RunDir(d)), rep)
    r = generate(cfg, d)
    rep = verify_run(load_plan_checked(RunDir(d)))
    assert r is not None and rep.ok, rep.defects
    assert content(d) == want, "repaired but not identical"
    return "repaired by verify --repair"


def _subset(got: dict, want: dict) -> bool:
    return all(want.get(k) == v for k, v in got.items())
