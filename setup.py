"""The build mapping of the design card's layout (everything else is in pyproject.toml).

The top-level ``conf/`` (the Hydra tree) and ``sweeps/`` (the stored sweeps) are the sources users edit; a
wheel carries them as the package data ``pnpscale/conf/`` and ``pnpscale/conf/sweeps/``, mapped here, not
copied: :data:`pnpscale.core.config.CONF_DIR` finds either layout.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[
        *find_namespace_packages(include=["pnpscale*", "hydra_plugins*"]),
        "pnpscale.conf",  # conf/
        "pnpscale.conf.sweeps",  # sweeps/
    ],
    package_dir={"pnpscale.conf": "conf", "pnpscale.conf.sweeps": "sweeps"},
)
