"""The packages of the wheel. Everything else is in pyproject.toml.

conf/ (Hydra's YAML) stays at the top of the checkout, beside jobs/ and parallel/, and is the one copy of the
config: the wheel carries it as the package data of ``shardgen.conf`` (``shardgen/config/paths.py`` finds it
in either place). pyproject.toml alone cannot map a folder outside the package into it while also finding the
packages, hence this file.
"""

from setuptools import find_namespace_packages, find_packages, setup

CONF_GROUPS = [f"shardgen.conf.{group}" for group in find_namespace_packages(where="conf")]

setup(
    packages=[*find_packages(include=["jobs*", "parallel*", "shardgen*"]), "shardgen.conf", *CONF_GROUPS],
    package_dir={"shardgen.conf": "conf"},
    package_data={"shardgen.conf": ["*.yaml"], **{group: ["*.yaml"] for group in CONF_GROUPS}},
)
