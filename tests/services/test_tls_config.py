"""TLS flags of every process: all three or none, from flags or ``PDSERVE_TLS_*``, files that
exist; and the gateway's public TLS and key-file flags, whose errors never show a key."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.certs import write_deployment
from gateway.config import parse_gateway_config
from services.node.config import Role, parse_node_config
from services.tls import TlsFiles


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    write_deployment(directory, ["node"])
    return directory


def test_node_tls_from_flags_or_environment(certs: Path) -> None:
    assert parse_node_config([], {}, role=Role.DECODE).tls is None
    environ = {
        "PDSERVE_TLS_CERT": str(certs / "node.crt"),
        "PDSERVE_TLS_KEY": str(certs / "node.key"),
        "PDSERVE_TLS_CA": str(certs / "ca.crt"),
    }
    expected = TlsFiles(certs / "node.crt", certs / "node.key", certs / "ca.crt")
    assert parse_node_config([], environ, role=Role.DECODE).tls == expected
    flags = ["--tls-cert", str(certs / "node.crt"), "--tls-key", str(certs / "node.key"),
             "--tls-ca", str(certs / "ca.crt")]  # fmt: skip
    assert parse_node_config(flags, {}, role=Role.PREFILL).tls == expected


def test_node_tls_needs_all_three_readable_files(certs: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_node_config(["--tls-cert", str(certs / "node.crt")], {}, role=Role.DECODE)
    assert exit_.value.code == 2
    assert "missing --tls-key, --tls-ca" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_node_config(
            ["--tls-cert", str(certs / "node.crt"), "--tls-key", str(certs / "node.key"),
             "--tls-ca", str(certs / "nope.crt")],
            {},
            role=Role.DECODE,
        )  # fmt: skip
    assert "--tls-ca:" in capsys.readouterr().err


def test_gateway_public_tls_and_key_file_errors(tiny_llama_dir: Path, certs: Path, capsys) -> None:
    base = ["--model", str(tiny_llama_dir), "--colocated", "127.0.0.1:50081"]
    config = parse_gateway_config(
        [*base, "--public-tls-cert", str(certs / "node.crt"),
         "--public-tls-key", str(certs / "node.key")],
        {},
    )  # fmt: skip
    assert config.public_tls is not None and config.tls is None
    with pytest.raises(SystemExit):
        parse_gateway_config([*base, "--public-tls-cert", str(certs / "node.crt")], {})
    assert "--public-tls-cert and --public-tls-key" in capsys.readouterr().err

    secret = "sk-gateway-config-91ab"
    keys = certs / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: team-a, key: {secret}, tokens_per_minute: -5}}\n")
    with pytest.raises(SystemExit):
        parse_gateway_config([*base, "--api-key-file", str(keys)], {})
    err = capsys.readouterr().err
    assert "tokens_per_minute" in err and secret not in err
    # One key given both by --api-key and by the file is refused, without showing it.
    keys.write_text(f"keys:\n  - {{name: team-a, key: {secret}}}\n")
    with pytest.raises(SystemExit):
        parse_gateway_config([*base, "--api-key", secret, "--api-key-file", str(keys)], {})
    err = capsys.readouterr().err
    assert "same key" in err and secret not in err
    config = parse_gateway_config([*base, "--api-key", "legacy", "--api-key-file", str(keys)], {})
    assert secret not in repr(config) and "legacy" not in repr(config)


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key", "--tls-ca"])
def test_tls_files_that_are_not_pem_are_refused_by_flag(
    certs: Path, tmp_path: Path, capsys, flag: str
) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    files = {"--tls-cert": certs / "node.crt", "--tls-key": certs / "node.key",
             "--tls-ca": certs / "ca.crt"}  # fmt: skip
    files[flag] = garbage
    argv = [item for pair in files.items() for item in (pair[0], str(pair[1]))]
    with pytest.raises(SystemExit) as exit_:
        parse_node_config(argv, {}, role=Role.DECODE)
    assert exit_.value.code == 2
    assert f"{flag} {garbage}: not a PEM" in capsys.readouterr().err


def test_tls_key_that_does_not_match_the_cert_is_refused(certs: Path, capsys) -> None:
    # ca.key is a valid key, but not node.crt's.
    argv = ["--tls-cert", str(certs / "node.crt"), "--tls-key", str(certs / "ca.key"),
            "--tls-ca", str(certs / "ca.crt")]  # fmt: skip
    with pytest.raises(SystemExit):
        parse_node_config(argv, {}, role=Role.DECODE)
    assert "--tls-key" in capsys.readouterr().err


def test_gateway_tls_files_that_are_not_pem_are_refused(
    tiny_llama_dir: Path, certs: Path, tmp_path: Path, capsys
) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"\x00\x01 junk")
    base = ["--model", str(tiny_llama_dir), "--colocated", "127.0.0.1:50081"]
    with pytest.raises(SystemExit) as exit_:
        parse_gateway_config(
            [*base, "--public-tls-cert", str(garbage), "--public-tls-key", str(certs / "node.key")],
            {},
        )
    assert exit_.value.code == 2
    assert f"--public-tls-cert {garbage}: not a PEM certificate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_gateway_config(
            [*base, "--public-tls-cert", str(certs / "node.crt"), "--public-tls-key", str(garbage)],
            {},
        )
    assert f"--public-tls-key {garbage}: not a PEM private key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_gateway_config(
            [*base, "--tls-cert", str(certs / "node.crt"), "--tls-key", str(certs / "node.key"),
             "--tls-ca", str(garbage)],
            {},
        )  # fmt: skip
    assert f"--tls-ca {garbage}: not a PEM certificate" in capsys.readouterr().err
