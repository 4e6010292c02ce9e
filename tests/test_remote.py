"""Prompts and shards on object storage, against a real S3-compatible server (tests/s3_server.py)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.generate import run
from tests.conftest import compose_cfg

FAST = ("height=16", "width=16", "steps=1", "progress=false", "batch_size=4")


def put(s3, url: str, data: bytes) -> None:
    s3.fs().pipe(url, data)


def test_prompts_from_a_bucket_txt_and_parquet(s3, bucket, tmp_path):
    lines = [f"a prompt number {i}" for i in range(10)]
    put(s3, f"s3://{bucket}/captions.txt", "".join(p + "\n" for p in lines).encode())
    result = run(compose_cfg(f"run_dir={tmp_path / 'txt'}", f"prompts.path=s3://{bucket}/captions.txt",
                             "samples_per_shard=4", *FAST))
    assert (result.ok, result.complete) == (10, True)
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"prompt": lines, "n": list(range(10))}), buf, row_group_size=3)
    put(s3, f"s3://{bucket}/captions.parquet", buf.getvalue().to_pybytes())
    result = run(compose_cfg(f"run_dir={tmp_path / 'pq'}", "prompts=parquet",
                             f"prompts.path=s3://{bucket}/captions.parquet",
                             "samples_per_shard=4", *FAST))
    assert (result.ok, result.complete) == (10, True)
    hashed = json.loads((tmp_path / "pq" / "prompt_hash.json").read_text())
    assert hashed["path"] == f"s3://{bucket}/captions.parquet" and hashed["etag"]


def bucket_samples(s3, url: str) -> dict[str, list[str]]:
    """shard name -> the keys of its tar, over the shards whose stats (the done marker) are in the bucket."""
    import io
    import tarfile

    fs, out = s3.fs(), {}
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(url, refresh=True)}
    for stats in sorted(n for n in names if n.endswith(".stats.json")):
        shard = stats[:6]
        assert {f"{shard}.tar", f"{shard}.parquet"} <= names, f"{shard}: stats without its tar or index"
        data = fs.cat_file(f"{url}/{shard}.tar")
        assert len(data) == json.loads(fs.cat_file(f"{url}/{stats}"))["tar_bytes"]
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            out[shard] = sorted({m.name.split(".")[0] for m in tar.getmembers()})
    return out


def test_shards_to_a_bucket_with_keep_local_false(s3, bucket, tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose_cfg(f"run_dir={run_dir}", f"output_uri=s3://{bucket}/run", "keep_local=false", "prompts.limit=10",
                      "samples_per_shard=4", *FAST)
    assert run(cfg).complete
    keys = bucket_samples(s3, f"s3://{bucket}/run")
    assert sorted(k for ks in keys.values() for k in ks) == [f"{i:010d}" for i in range(10)]
    local = sorted(p.name for p in (run_dir / "shards").iterdir())
    assert local == [f"00000{i}.{ext}" for i in range(3) for ext in ("stats.json", "uploaded.json")]
    again = run(cfg)  # a complete run stays complete: nothing regenerated, nothing uploaded again
    assert again.complete and again.generated_here == 0
    assert sorted(p.name for p in (run_dir / "shards").iterdir()) == local
