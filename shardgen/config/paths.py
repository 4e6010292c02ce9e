"""Where the Hydra config (generate.yaml and its groups) is: one folder, found the same way by every entry point.

The YAML files live in ``conf/`` at the top of a checkout. A wheel carries that same folder as the package
data of ``shardgen.conf`` (setup.py maps it), so an installed shardgen runs outside any checkout.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # shardgen/


def conf_dir() -> Path:
    """The folder holding ``generate.yaml``: the installed package's ``shardgen/conf`` when there is one (a wheel),
    else the checkout's ``conf/`` beside the package (a checkout, or an editable install of one)."""
    installed = PACKAGE / "conf"
    if (installed / "generate.yaml").is_file():
        return installed
    return PACKAGE.parent / "conf"


CONF = conf_dir()
