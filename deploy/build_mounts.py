"""What a podman image build carries in from the host so that its ``pip install`` and
``apt-get`` reach what the host reaches: the host's pip configuration merged into one file
(every pip.conf pip reads, then the ``PIP_*`` environment, which wins as it does for pip), the
local paths it names (find-links directories, ``file://`` indexes, CA bundles), the host's proxy
variables, and the host network.

Everything is mounted read-only for the build only (``podman build --volume``): nothing of the
host's configuration ends up in an image.
"""

from __future__ import annotations

import configparser
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from deploy.podman import NOFILE, NPROC

PIP_CONFIG_FILES = (
    Path("/etc/xdg/pip/pip.conf"),
    Path("/etc/pip.conf"),
    Path.home() / ".pip" / "pip.conf",
    Path.home() / ".config" / "pip" / "pip.conf",
)
"""In pip's order: a later file's value wins."""
_PATH_OPTIONS = ("find-links", "index-url", "extra-index-url", "cert", "client-cert")
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
                    "no_proxy")  # fmt: skip
CONTAINER_PIP_CONF = "/etc/pip.conf"


def merged_pip_config(
    files: tuple[Path, ...] = PIP_CONFIG_FILES, env: dict[str, str] | None = None
) -> dict[str, str]:
    """pip's ``[global]`` options as the host's pip sees them (option name → value)."""
    env = dict(os.environ) if env is None else env
    options: dict[str, str] = {}
    for path in files:
        if path.is_file():
            parser = configparser.ConfigParser(interpolation=None)
            parser.read(path)
            for section in ("global", "install"):
                if parser.has_section(section):
                    options.update(parser.items(section))
    for key, value in env.items():
        if key.startswith("PIP_") and key != "PIP_CONFIG_FILE":
            options[key[4:].lower().replace("_", "-")] = value
    return options


def local_paths(options: dict[str, str]) -> list[Path]:
    """The existing host paths the options name, each once."""
    paths: list[Path] = []
    for option in _PATH_OPTIONS:
        for item in options.get(option, "").split():
            parsed = urlparse(item)
            if parsed.scheme in ("", "file"):
                path = Path(unquote(parsed.path))
                if option.endswith("index-url"):
                    path = path.parent if path.name == "simple" else path
                if path.is_absolute() and path.exists() and path not in paths:
                    paths.append(path)
    return paths


@dataclass
class BuildMounts:
    """Writes the merged pip.conf once; ``build_args()`` are the ``podman build`` flags."""

    options: dict[str, str] = field(default_factory=merged_pip_config)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    _conf_dir: tempfile.TemporaryDirectory[str] | None = None

    def pip_conf(self) -> Path:
        if self._conf_dir is None:
            self._conf_dir = tempfile.TemporaryDirectory(prefix="pdserve-pip-")
        path = Path(self._conf_dir.name) / "pip.conf"
        if not path.exists():
            lines = ["[global]", *(f"{k} = {v}" for k, v in sorted(self.options.items()))]
            path.write_text("\n".join(lines) + "\n")
            path.chmod(0o644)
            Path(self._conf_dir.name).chmod(0o755)
        return path

    def build_args(self) -> list[str]:
        args = ["--network", "host", "--ulimit", f"nofile={NOFILE}:{NOFILE}",
                "--ulimit", f"nproc={NPROC}:{NPROC}"]  # fmt: skip
        args += ["--volume", f"{self.pip_conf()}:{CONTAINER_PIP_CONF}:ro"]
        for path in local_paths(self.options):
            args += ["--volume", f"{path}:{path}:ro"]
        for name in _PROXY_VARIABLES:
            if name in self.env:
                args += ["--build-arg", f"{name}={self.env[name]}"]
        return args

    def close(self) -> None:
        if self._conf_dir is not None:
            self._conf_dir.cleanup()
            self._conf_dir = None
