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
