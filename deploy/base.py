"""The base images podman builds pdserve's images on when no image registry is reachable.

1. ``localhost/pdserve-debian:bookworm``: a Debian root file system bootstrapped with
   ``mmdebstrap --variant=minbase`` from Debian's mirror (which apt reaches) and imported with
   ``podman import``; ~180 MB.
2. ``localhost/pdserve-python:bookworm``: ``deploy/base/python.Containerfile`` on it, Debian's
   Python 3.11 in a venv on PATH, standing in for ``python:3.11-slim-bookworm``.

Each is built once and kept (``make down`` removes containers, not images); an image that exists
is never rebuilt here.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

from deploy.build_mounts import BuildMounts

logger = logging.getLogger(__name__)

DEBIAN_IMAGE = "localhost/pdserve-debian:bookworm"
PYTHON_IMAGE = "localhost/pdserve-python:bookworm"
SUITE = "bookworm"
CONTAINERFILE = Path(__file__).parent / "base" / "python.Containerfile"


def image_exists(podman: list[str], image: str, env: dict[str, str]) -> bool:
    return subprocess.run([*podman, "image", "exists", image], env=env, check=False).returncode == 0


def ensure_debian(podman: list[str], env: dict[str, str]) -> None:
    """``env``: podman's environment (``CONTAINERS_CONF``)."""
    if image_exists(podman, DEBIAN_IMAGE, env):
        return
    if shutil.which("mmdebstrap") is None:
        raise RuntimeError(
            f"{DEBIAN_IMAGE} is missing and mmdebstrap is not installed "
            "(apt-get install mmdebstrap), so no Debian base can be bootstrapped"
        )
    with tempfile.TemporaryDirectory(prefix="pdserve-debian-") as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        logger.info("bootstrapping Debian %s into %s", SUITE, tarball)
        subprocess.run(
            ["mmdebstrap", "--variant=minbase", "--include=ca-certificates", SUITE, str(tarball)],
            check=True,
        )
        subprocess.run([*podman, "import", str(tarball), DEBIAN_IMAGE], env=env, check=True)


def ensure_python(podman: list[str], mounts: BuildMounts, env: dict[str, str]) -> None:
    ensure_debian(podman, env)
    if image_exists(podman, PYTHON_IMAGE, env):
        return
    subprocess.run(
        [*podman, "build", *mounts.build_args(), "--build-arg", f"DEBIAN_IMAGE={DEBIAN_IMAGE}",
         "-f", str(CONTAINERFILE), "-t", PYTHON_IMAGE, str(CONTAINERFILE.parent)],
        env=env, check=True,
    )  # fmt: skip
