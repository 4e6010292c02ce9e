import traceback
from jobs.generate import run
from tests.conftest import compose_cfg
FAST = ("height=32", "width=32", "steps=2", "batch_size=2", "samples_per_shard=4", "progress=false")

def show(capsys, name, fn, args):
    capsys.readouterr()
    try:
        rc = fn(args)
    except BaseException as e:
        rc = repr(e)
        traceback.print_exc()
    out = capsys.readouterr()
    with capsys.disabled():
        print(f"\n=== {name} rc={rc}\nOUT:{out.out[-2500:]}\nERR:{out.err[-3000:]}")

def test_explore(tmp_path, s3, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s3.fs().mkdir("team-bucket")
    url = "s3://team-bucket/runs/parti"
    run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10"))
    from jobs import report, preview, dedup, signals, verify
    show(capsys, "report", report.main, [url])
    show(capsys, "preview", preview.main, [url])
    show(capsys, "signals", signals.main, [url, "signals=[phash]"])
    show(capsys, "dedup", dedup.main, [url])
    s3.fs().rm("team-bucket/runs/parti/shards/000001.tar")
    show(capsys, "verify", verify.main, [url])
    show(capsys, "repair", verify.main, [url, "--repair"])
    s3.fs().copy("team-bucket/runs/parti", "team-bucket/runs/parti-2", recursive=True)
    from shardgen.tools.loading import shard_paths
    with capsys.disabled():
        print(shard_paths(url)[:1], shard_paths(url, reader="datasets")[:1])
    run(compose_cfg(f"run_dir={url}", *FAST, "prompts.limit=10", "dry_run=true"))
    with capsys.disabled():
        print(capsys.readouterr().out)
