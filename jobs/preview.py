"""A contact sheet of a run's samples with their prompts, as one PNG (a run in progress: its committed shards,
then the durable samples of the shards in progress in work/).

    python -m jobs.preview RUN_DIR [--n 16] [--cols 4] [--size 256] [--out RUN_DIR/preview.png] [--force]
"""

from __future__ import annotations

import io
import json
import sys
import textwrap
from pathlib import Path

from PIL.PngImagePlugin import PngInfo

from shardgen.cli import run_program
from shardgen.dataio.rundir import RunDir
from shardgen.dataio.shards import VIDEO_EXT, durable_partial, image_ext, preview_png
from shardgen.errors import UserError
from shardgen.tools import check_tool_output, committed_members, count_arg, read_shard_members, safe_write
from shardgen.tools.entry import run_tool, tool_parser
from shardgen.tools.runfiles import refuse_foreign_out, share_output

SOFTWARE = "shardgen jobs.preview"  # the sheet's PNG Software text
SHEET_MARK = b"tEXtSoftware\x00" + SOFTWARE.encode()  # that text chunk's bytes, near the start of every sheet


def _members(run: RunDir, num_shards: int):
    """(key, members) of the committed shards, then of the durable prefixes of the partial ones in work/;
    damaged tars and links are skipped (jobs.verify names them)."""
    yield from committed_members(run)
    done = run.done_shards()
    for shard in range(num_shards):
        if shard in done or (data := durable_partial(run, shard)) is None:
            continue
        try:
            members = read_shard_members(io.BytesIO(data), run.container)
        except Exception:  # a damaged partial is shown as nothing, like a damaged committed tar
            continue
        yield from sorted(members.items())


def collect(run: RunDir, n: int, num_shards: int = 0) -> list[tuple[str, bytes | None, dict]]:
    """Up to ``n`` (prompt, image bytes or None, json) from the committed shards, in key order, then from the
    durable part of the ``num_shards`` shards' partials in work/."""
    out = []
    for key, mem in _members(run, num_shards):
        img = mem[image_ext(mem)] if image_ext(mem) else None
        if VIDEO_EXT in mem:  # a video: four of its frames in a grid
            try:
                img = preview_png(mem[VIDEO_EXT])
            except (ValueError, OSError) as e:  # damaged: a cell without a picture, as a failed sample's
                print(f"jobs.preview: sample {key}: its video does not decode ({e}); shown without a picture",
                      file=sys.stderr)
                img = None
        out.append((mem.get("txt", b"").decode("utf-8", "replace"), img, _meta(mem.get("json"))))
        if len(out) == n:
            return out
    return out


def _meta(data: bytes | None) -> dict:
    """A sample's json, or {} when it is damaged."""
    try:
        meta = json.loads(data or b"{}")
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


TEXT_H = 48  # the prompt's lines under each cell
MAX_SHEET_PIXELS = 100_000_000  # ~300 MB of RGB in memory while the sheet is drawn


def sheet_pixels(n: int, cols: int, size: int) -> int:
    """Pixels of a sheet of ``n`` cells (what ``contact_sheet`` allocates, checked before anything is read)."""
    cols = min(cols, n)
    return cols * size * -(-n // cols) * (size + TEXT_H)


def contact_sheet(items, cols: int, size: int):
    """A grid image: each cell the sample (or its failure) above its wrapped prompt."""
    from PIL import Image, ImageDraw

    from shardgen.rasters import open_raster, to_rgb

    text_h = TEXT_H
    rows = max(1, (len(items) + cols - 1) // cols)
    sheet = Image.new("RGB", (cols * size, rows * (size + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (prompt, img, meta) in enumerate(items):
        x, y = (i % cols) * size, (i // cols) * (size + text_h)
        try:
            sheet.paste(to_rgb(open_raster(img, "the sample")).resize((size, size)), (x, y))
        except Exception:  # no image (a failure, a reject), or one that does not decode
            draw.rectangle([x, y, x + size - 1, y + size - 1], fill=(60, 0, 0))
            draw.text((x + 4, y + 4), f"{meta.get('status')}: {str(meta.get('error', ''))[:60]}", fill="white")
        label = f"{meta.get('index', '?')}: {prompt}"
        draw.multiline_text((x + 2, y + size + 2), "\n".join(textwrap.wrap(label, width=max(10, size // 7))[:3]),
                            fill="black")
    return sheet


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("python -m jobs.preview", __doc__)
    ap.add_argument("--n", type=count_arg(1), default=16, help="samples on the sheet, in key order (default 16)")
    ap.add_argument("--cols", type=count_arg(1), default=4, help="samples per row (default 4)")
    ap.add_argument("--size", type=count_arg(16), default=256, help="side of each cell in pixels (default 256); the sheet "
                    "may hold at most 100 megapixels")
    ap.add_argument("--out", default=None, help="the PNG to write (default RUN_DIR/preview.png)")
    ap.add_argument("--force", action="store_true",
                    help="replace --out even when it exists and is not a sheet this tool wrote")
    return run_tool(ap, argv, preview, check=_check_sheet_size)


def _check_sheet_size(args) -> None:
    if (pixels := sheet_pixels(args.n, args.cols, args.size)) > MAX_SHEET_PIXELS:
        raise UserError(f"a sheet of --n {args.n} cells of --size {args.size} in --cols {args.cols} would be "
                        f"{pixels / 1e6:.0f} megapixels, over {MAX_SHEET_PIXELS // 10**6}; lower --n or --size")


def preview(args, plan) -> int:
    """Write the contact sheet of ``plan``'s run."""
    run = plan.run
    out = Path(args.out) if args.out else run.preview_path
    check_tool_output(out, run)
    if not args.force:
        refuse_foreign_out(out, run.preview_path, SHEET_MARK, "jobs.preview")  # a user's file is never replaced unasked
    items = collect(run, args.n, plan.num_shards)
    if not items:
        print(f"{args.run_dir}: no sample is durable yet (no committed shard, no checkpointed batch in work/)",
              file=sys.stderr)
        return 1
    buf = io.BytesIO()
    info = PngInfo()
    info.add_text("Software", SOFTWARE)  # SHEET_MARK: how a later --out knows the file as this tool's
    contact_sheet(items, args.cols, args.size).save(buf, format="PNG", pnginfo=info)
    if out.is_symlink():
        print(f"note: {out} was a symlink; it is replaced by the file (the link's target is left alone)")
    safe_write(out, buf.getvalue(), run)  # a fresh file renamed into place: never written through a link
    print(f"wrote {share_output(run, out)} ({len(items)} samples)")
    return 0


if __name__ == "__main__":
    run_program(main, "jobs.preview")
