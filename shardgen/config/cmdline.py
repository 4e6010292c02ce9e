"""What Hydra's override parser cannot take, found before it runs: its message ("LexerNoViableAltException")
names neither the cause nor the fix."""

from __future__ import annotations

import locale
import os


def _unquoted_non_ascii(value: str) -> bool:
    """Whether ``value`` has a non-ASCII character outside '...' or "..." (Hydra's grammar takes them only quoted)."""
    quote, escaped = None, False
    for c in value:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif ord(c) > 127:
            return True
    return False


def command_line_problem(argv: list[str]) -> str | None:
    """The one-line refusal of an override Hydra's parser would fail on, naming the fix; None when there is none."""
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key.startswith("-"):
            continue
        if any("\udc80" <= c <= "\udcff" for c in arg):  # bytes the locale's encoding could not decode
            where = os.environ.get("LC_ALL") or os.environ.get("LC_CTYPE") or os.environ.get("LANG") or "unset"
            return (f"{key}=...: the command line has bytes that are not text in this locale's encoding "
                    f"({locale.getpreferredencoding(False)}; LC_ALL/LC_CTYPE/LANG={where}, e.g. an ASCII locale from "
                    "cron or ssh). Set a UTF-8 locale (export LC_ALL=C.UTF-8) and quote the value: "
                    f"'{key}=\"...\"'")
        if _unquoted_non_ascii(value):
            return (f"{arg}: Hydra's command-line grammar takes non-ASCII characters only inside quotes; quote the "
                    f"value within the shell's quotes: '{key}=\"{value}\"'")
    return None
