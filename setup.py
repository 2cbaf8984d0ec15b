"""The one packaging setting pyproject.toml cannot say: the repository's conf/ ships as the
package `varlen.conf`, so that no top-level `conf` is installed (nor shadowed by a user's conf/)."""

from setuptools import find_namespace_packages, setup

setup(packages=[*find_namespace_packages(include=["varlen*", "backends*", "schedulers*", "sim*", "hydra_plugins*"]), "varlen.conf"],
      package_dir={"varlen.conf": "conf"})
