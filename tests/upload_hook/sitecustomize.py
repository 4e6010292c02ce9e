"""Loaded by any Python started with this folder on PYTHONPATH (``site`` imports ``sitecustomize``), so that the real
``python -m jobs.generate`` runs with one change: with ``SHARDGEN_TEST_UPLOAD_STOP=WHEN:NAME:FLAG`` set, the shard
uploader stops for good (until killed) ``before`` or ``after`` it sends the object NAME (``000001.tar``), once it
has touched the file FLAG. Deterministic kill points inside an upload for tests/test_remote.py."""

import os

_spec = os.environ.get("SHARDGEN_TEST_UPLOAD_STOP")
if _spec:
    import pathlib
    import time

    import shardgen.dataio.shards.upload as _upload

    _when, _name, _flag = _spec.split(":", 2)
    _real = _upload.ShardUploader._send

    def _stop() -> None:
        pathlib.Path(_flag).touch()
        time.sleep(600)

    def _send(self, local):
        if _when == "before" and local.name == _name:
            _stop()
        out = _real(self, local)
        if _when == "after" and local.name == _name:
            _stop()
        return out

    _upload.ShardUploader._send = _send
