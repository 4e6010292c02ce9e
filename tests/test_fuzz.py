"""Seeded fuzzing of prompt rows and config values: each case is a completed run that verifies, or a
refusal by a user error (a message, no traceback) that wrote nothing. A seeded generator of our own, like the
fault injection's: no extra dependency, and a failing case is reproduced by its number (FUZZ_CASES, FUZZ_SEED)."""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from jobs import verify
from jobs.generate import run
from shardgen.errors import UserError
from tests.conftest import compose_cfg
from tests.test_integrity_faults import fast_model  # noqa: F401 (fixture: the model loaded once)

CASES = int(os.environ.get("FUZZ_CASES", 40))
SEED = int(os.environ.get("FUZZ_SEED", 25))
BASE = ("height=16", "width=16", "steps=1", "progress=false", "batch_size=2")

TEXTS = ["a cat", "", " ", "\t\n", "é🙂中文", "\u202eright-to-left", "nul\x00byte", "x" * 300, "line\rbreak",
         "<script>alert(1)</script>", "../../etc/passwd", "\\ud800", "a\u0301" * 20, "0", "null",
         "\x1b]0;retitled\x07\x1b[2J"]
NAMES = ["prompt", "seed", "signals", "provenance", "tokens", "truncated", "extra", "key", "status", "error", "index",
         "", "a.b", "../x", "__proto__", "名字", "x" * 200, "json", "txt", "png"]
CONFIG = {"batch_size": ["1", "3", "0", "-1"], "samples_per_shard": ["1", "2", "null", "0", "-5"],
          "height": ["16", "32", "15", "0", "-16", "100000"], "width": ["16", "32", "17"], "steps": ["1", "2", "0", "-1"],
          "seed": ["0", "-1", "18446744073709551616", "7"], "image_format": ["png", "jpg", "webp", "bmp"],
          "image_quality": ["1", "100", "0", "101"], "prompts.on_bad_row": ["error", "skip", "maybe"],
          "prompts.max_prompt_chars": ["5", "100000", "0", "1"], "prompts.limit": ["null", "1", "0", "-1"],
          "guidance": ["0", "3.5", "-1", "1e308", "inf", "nan"], "lease_s": ["60", "0", "-1"],
          "model.negative_prompt": ["null", "no", "n" * 200]}


def value(rng: random.Random, depth: int = 0):
    """A JSON value of any type and size: strings of every kind, huge and negative numbers, nesting."""
    kind = rng.randrange(9 if depth < 3 else 6)
    return [lambda: rng.choice(TEXTS), lambda: rng.choice([0, -1, 1, 2**63 - 1, 2**63, 10**30, -10**30, 10**400]),
            lambda: rng.choice([0.5, -0.0, 1e308, -1e-308, 3.0]), lambda: None, lambda: rng.random() < 0.5,
            lambda: rng.choice(TEXTS) * rng.randint(1, 3),
            lambda: [value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            lambda: {rng.choice(NAMES): value(rng, depth + 1) for _ in range(rng.randint(0, 3))},
            lambda: {"phash": "ffffffffffffffff", "clip_score": 0.99}][kind]()


def prompt_file(rng: random.Random, d: Path) -> Path:
    """A prompt file of 1-5 rows in a random format; most rows good, some not."""
    fmt = rng.choice(["jsonl", "jsonl", "jsonl", "txt", "csv"])
    n = rng.randint(1, 5)
    if fmt == "txt":
        lines = [rng.choice(TEXTS) if rng.random() < 0.3 else f"a photo {i}" for i in range(n)]
        path = d / "p.txt"
        path.write_bytes(b"".join(t.encode("utf-8", "surrogatepass") + b"\n" for t in lines))
    elif fmt == "csv":
        path = d / "p.csv"
        path.write_text("prompt,seed,note\n" + "".join(
            f'"{rng.choice(TEXTS).replace(chr(34), "")}",{rng.choice(["", "1", "-1", "x", "99999999999999999999"])},'
            f"{rng.choice(NAMES)}\n" for _ in range(n)), encoding="utf-8", errors="surrogatepass")
    else:
        path = d / "p.jsonl"
        rows = []
        for i in range(n):
            row = {rng.choice(NAMES): value(rng) for _ in range(rng.randint(0, 4))}
            if rng.random() < 0.7:
                row["prompt"] = f"a photo {i}" if rng.random() < 0.6 else value(rng)
            if rng.random() < 0.3:
                row["seed"] = value(rng)
            rows.append(json.dumps(row) if rng.random() < 0.9 else rng.choice(["{", "[]", "", "null", '{"prompt": NaN}']))
        path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    return path


def config_overrides(rng: random.Random) -> list[str]:
    """A few config values, each from its good and bad range."""
    keys = rng.sample(sorted(CONFIG), rng.choice([0, 0, 1, 1, 2, 3]))
    skip = ["prompts.on_bad_row=skip"] if rng.random() < 0.6 and "prompts.on_bad_row" not in keys else []
    return [f"{k}={rng.choice(CONFIG[k])}" for k in keys] + skip


@pytest.mark.slow
def test_fuzzed_rows_and_config_complete_and_verify_or_are_refused_writing_nothing(tmp_path, fast_model, capsys):
    logging.getLogger("shardgen").setLevel(logging.CRITICAL)
    rng = random.Random(SEED)
    outcomes = {"completed": 0, "refused": 0}
    for case in range(CASES):
        d = tmp_path / f"case{case}"
        d.mkdir()
        path = prompt_file(rng, d)
        overrides = config_overrides(rng)
        run_dir = d / "run"
        what = f"case {case}: {path.read_bytes()[:300]!r} {overrides}"
        try:
            cfg = compose_cfg(f"run_dir={run_dir}", f"prompts.path={path}", "prompts.format=auto", *BASE, *overrides)
        except (HydraException, OmegaConfBaseException) as e:  # the command line is refused while composing
            outcomes["refused"] += 1
            if os.environ.get("FUZZ_SHOW"):
                print(f"refused: {str(e)[:160]}", file=sys.__stderr__)
            continue
        try:
            result = run(cfg)
        except UserError as e:
            assert str(e).strip() and "Traceback" not in str(e), what
            assert not run_dir.exists(), f"{what}: refused ({e}) but wrote {sorted(os.listdir(run_dir))}"
            outcomes["refused"] += 1
            if os.environ.get("FUZZ_SHOW"):
                print(f"refused: {str(e)[:160]}", file=sys.__stderr__)
            continue
        except Exception as e:
            raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
        assert result.complete, what
        assert verify.main([str(run_dir), "--no-decode"]) == 0, f"{what}: {capsys.readouterr().out[-2000:]}"
        outcomes["completed"] += 1
        capsys.readouterr()
    print(CASES, "cases:", outcomes)
    assert outcomes["completed"] >= CASES // 5 and outcomes["refused"] >= CASES // 5
