"""benchmarks/gpu_session.py dry-runs anywhere: every stage either runs or says why it cannot,
and the session still writes its JSON and table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_session():
    spec = importlib.util.spec_from_file_location(
        "benchmarks_gpu_session", ROOT / "benchmarks/gpu_session.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_reports_every_stage(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    session = load_session()
    assert session.main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "session.json").read_text())
    assert list(results) == list(session.STAGES)
    assert results["versions"]["status"] == "ok"
    assert results["versions"]["result"]["torch"]
    for name, entry in results.items():
        assert entry["status"] in ("ok", "skipped"), (name, entry)
        if entry["status"] == "skipped":
            assert entry["reason"], name
    table = capsys.readouterr().out
    for name in session.STAGES:
        assert f"| {name} |" in table


def test_a_failing_stage_is_recorded_and_the_session_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = load_session()

    def broken(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(session, "stage_versions", broken)
    assert session.main(["--dry-run", "--out", str(tmp_path)]) == 1
    results = json.loads((tmp_path / "session.json").read_text())
    failed = results["versions"]
    assert (failed["status"], failed["reason"]) == ("failed", "RuntimeError: boom")
    assert "in broken" in failed["traceback"]
    assert results["copy_bandwidth"]["status"] == "skipped"


def test_stages_left_when_the_budget_runs_out_say_so(tmp_path: Path) -> None:
    session = load_session()
    assert session.main(["--dry-run", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "session.json").read_text())
    assert {entry["reason"] for entry in results.values()} == {"the session's --budget-s ran out"}


def test_gpu_tests_stage_collects_every_module_with_gpu_tests() -> None:
    files = load_session().gpu_test_files()
    assert "tests/models/test_triton_attention.py" in files
    assert "tests/kv_transfer/test_cuda_ipc.py" in files
    assert all((ROOT / f).read_text().count("mark.gpu") for f in files)


def test_unknown_stage_is_a_usage_error(tmp_path: Path) -> None:
    session = load_session()
    with pytest.raises(SystemExit) as exc:
        session.main(["--dry-run", "--out", str(tmp_path), "--only", "versions,nope"])
    assert exc.value.code == 2


def test_the_launcher_stage_serves_on_the_cpu(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The ``launcher`` stage's work, with no GPU pin: a GPU lease must not be the first run."""
    session = load_session()
    result = session.launch_and_ask(tiny_llama_dir, [], tmp_path, session.Deadline(300))
    assert result["chat"]["status"] == 200, result
    assert json.loads(result["chat"]["body"])["choices"][0]["message"]["content"]
    assert result["stream"]["status"] == 200 and result["stream"]["done"], result
    assert result["exit_code"] == 0, result["log_tail"]
    assert "gpu_ids" not in result["topology"]["prefill"]
