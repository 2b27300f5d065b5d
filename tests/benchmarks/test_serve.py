"""benchmarks/serve.py: metrics on synthetic records, and the client against a fake SSE server.

No test here asserts on wall-clock time: latencies are checked as exact functions of records
built by hand, and the client end to end only for counts, errors and what it writes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import re
import statistics
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web

from deploy.local_ports import free_ports

ROOT = Path(__file__).resolve().parents[2]


def load_serve() -> ModuleType:
    # benchmarks/ is a directory of scripts, not a package: load the file by path.
    spec = importlib.util.spec_from_file_location("benchmarks_serve", ROOT / "benchmarks/serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


serve = load_serve()


def make_record(
    ttft: float = 0.1,
    e2el: float = 1.1,
    num_output_tokens: int = 11,
    itl: list[float] | None = None,
    prompt_len: int = 8,
    output_len: int | None = None,
    error: str | None = None,
) -> Any:
    if error is not None:
        return serve.RequestRecord(0, prompt_len, output_len or num_output_tokens, error=error)
    return serve.RequestRecord(
        0,
        prompt_len,
        output_len or num_output_tokens,
        success=True,
        ttft_s=ttft,
        e2el_s=e2el,
        itl_s=itl or [],
        num_content_chunks=num_output_tokens,
        num_output_tokens=num_output_tokens,
    )


# --------------------------------------------------------------------------------------------
# Metrics


def test_distribution_matches_numpy_linear_percentiles() -> None:
    stats = serve.distribution([float(v) for v in range(1, 101)])
    assert stats == pytest.approx({"mean": 50.5, "median": 50.5, "p90": 90.1, "p99": 99.01})
    assert serve.distribution([3.0]) == {"mean": 3.0, "median": 3.0, "p90": 3.0, "p99": 3.0}
    assert serve.distribution([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token() -> None:
    assert serve.tpot_s(make_record(ttft=0.1, e2el=1.1, num_output_tokens=11)) == pytest.approx(0.1)
    assert serve.tpot_s(make_record(num_output_tokens=1)) is None  # undefined for one token
    assert serve.tpot_s(make_record(error="HTTP 500: x")) is None


def test_summarize_is_exact_on_synthetic_records() -> None:
    records = [
        make_record(ttft=0.1, e2el=1.1, num_output_tokens=11, itl=[0.1] * 10, prompt_len=10),
        make_record(ttft=0.3, e2el=0.7, num_output_tokens=5, itl=[0.1, 0.1, 0.1, 0.1]),
        make_record(ttft=0.2, e2el=0.2, num_output_tokens=1, output_len=4),  # cut short
        make_record(error="HTTP 503: overloaded"),
        make_record(error="HTTP 503: overloaded"),
        make_record(error="timeout after 5 s"),
    ]
    summary = serve.summarize(records, duration_s=2.0, slos_ms={"ttft": 250.0})

    assert summary["completed"] == 3 and summary["failed"] == 3
    assert summary["errors"] == {"HTTP 503: overloaded": 2, "timeout after 5 s": 1}
    assert summary["total_input_tokens"] == 10 + 8 + 8
    assert summary["total_output_tokens"] == 11 + 5 + 1
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(17 / 2)
    assert summary["total_token_throughput"] == pytest.approx(43 / 2)
    assert summary["num_short_outputs"] == 1
    assert summary["request_goodput"] == pytest.approx(2 / 2)  # TTFT 300 ms misses the SLO
    assert summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert summary["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT only over requests with 2+ tokens: 100 ms and (700 - 300) / 4 = 100 ms.
    assert summary["mean_tpot_ms"] == pytest.approx(100.0)
    assert summary["p99_tpot_ms"] == pytest.approx(100.0)
    assert summary["mean_itl_ms"] == pytest.approx(100.0)  # 14 gaps pooled
    assert summary["mean_e2el_ms"] == pytest.approx(2000.0 / 3)
    assert summary["p90_e2el_ms"] == pytest.approx(1020.0)  # between 700 and 1100 ms


def test_summary_of_a_run_with_no_success_has_no_latencies() -> None:
    summary = serve.summarize([make_record(error="boom")], duration_s=1.0)
    assert summary["completed"] == 0 and summary["output_throughput"] == 0.0
    assert summary["mean_ttft_ms"] is None and summary["request_goodput"] is None
    assert "n/a" in serve.format_summary(summary)


def test_goodput_needs_every_slo_and_tpot_binds_only_multi_token_requests() -> None:
    slos = {"ttft": 200.0, "tpot": 50.0, "e2el": 1000.0}
    one_token = make_record(ttft=0.1, e2el=0.1, num_output_tokens=1)
    assert serve.meets_slos(one_token, slos)
    assert serve.meets_slos(make_record(ttft=0.2, e2el=0.65, num_output_tokens=10), slos)
    assert not serve.meets_slos(make_record(ttft=0.2, e2el=0.8, num_output_tokens=10), slos)
    assert not serve.meets_slos(make_record(ttft=0.21, e2el=0.21, num_output_tokens=1), slos)
    assert not serve.meets_slos(make_record(ttft=0.1, e2el=1.5, num_output_tokens=100), slos)
    assert not serve.meets_slos(make_record(error="x"), slos)


def test_parse_goodput() -> None:
    assert serve.parse_goodput(["ttft:2000", "tpot:100"]) == {"ttft": 2000.0, "tpot": 100.0}
    assert serve.parse_goodput([]) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["e2el:0"]):
        with pytest.raises(ValueError):
            serve.parse_goodput(bad)


# --------------------------------------------------------------------------------------------
# Workload


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate() -> None:
    offsets = serve.arrival_offsets(20_000, request_rate=4.0, seed=7)
    assert offsets == serve.arrival_offsets(20_000, request_rate=4.0, seed=7)
    assert offsets != serve.arrival_offsets(20_000, request_rate=4.0, seed=8)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)


def test_burstiness_keeps_the_rate_and_widens_the_gaps() -> None:
    offsets = serve.arrival_offsets(20_000, request_rate=4.0, seed=0, burstiness=0.25)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) > 1.5 * 0.25  # gamma shape k: stdev = mean / sqrt(k)


def test_infinite_rate_is_a_burst() -> None:
    assert serve.arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError):
        serve.arrival_offsets(5, 0.0, seed=0)


def test_shared_prefix_prompts() -> None:
    prompts = serve.random_token_prompts(
        6, input_len=12, pool=range(100, 200), seed=0, shared_prefix_len=8, num_prefixes=2
    )
    assert [len(p) for p in prompts] == [12] * 6
    assert all(100 <= t < 200 for p in prompts for t in p)
    assert prompts[0][:8] == prompts[2][:8] == prompts[4][:8]
    assert prompts[1][:8] == prompts[3][:8] == prompts[5][:8]
    assert prompts[0][:8] != prompts[1][:8]
    assert len({tuple(p[8:]) for p in prompts}) == 6
    with pytest.raises(ValueError):
        serve.random_token_prompts(1, input_len=4, pool=range(10), seed=0, shared_prefix_len=5)


def test_text_prompts_encode_to_the_asked_length(tiny_llama_dir: Path) -> None:
    tokenizer = serve.load_tokenizer(tiny_llama_dir)
    pool = serve.prompt_token_pool(tokenizer)
    special = set(tokenizer.get_added_tokens_decoder())
    assert pool and not special & set(pool)
    rng = random.Random(0)
    for length in (1, 7, 64, 256):
        for ids in serve.random_token_prompts(10, length, pool, seed=length):
            text, num = serve.fit_text(tokenizer, ids, pool, rng)
            assert num == len(tokenizer.encode(text, add_special_tokens=False).ids) == length


def test_sse_decoder_reassembles_events_split_anywhere() -> None:
    stream = 'data: {"text": "é"}\r\n\r\n: a comment\ndata: a\ndata: b\n\ndata: [DONE]\n\n'
    raw = stream.encode()
    for cut in range(1, len(raw)):
        decoder = serve.SseDecoder()
        events = decoder.feed(raw[:cut]) + decoder.feed(raw[cut:])
        assert events == ['{"text": "é"}', "a\nb", "[DONE]"], cut


def test_only_loopback_hosts_are_local() -> None:
    for url in (
        "http://127.0.0.1:8000",
        "http://localhost/v1",
        "http://[::1]:80",
        "http://127.9.0.1",
    ):
        assert serve.is_local_url(url), url
    for url in ("http://10.0.0.1:8000", "https://api.openai.com/v1", "http://0.0.0.0:80", "x"):
        assert not serve.is_local_url(url), url


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "https://example.com"])
def test_the_command_refuses_remote_hosts(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--base-url", url, "--model", "m", "--num-prompts", "1"])
    assert exit_info.value.code == 2
    assert "not a loopback address" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The client against a fake OpenAI server


@dataclass
class FakeOpenAI:
    """Streams scripted completions; ``behaviours`` cycle over requests in arrival order.

    ok: one empty chunk, then tokens ``tokens_per_chunk`` at a time, a finish chunk, usage
    (when ``send_usage``) and [DONE]. http_error: 503. error_event: two chunks, then an error
    event. cut: tokens but no [DONE]. garbage: chunks that are not JSON objects. hang: headers,
    then nothing until released.
    """

    behaviours: list[str]
    tokens_per_chunk: int = 1
    send_usage: bool = True
    bodies: list[dict[str, Any]] = field(default_factory=list)
    num_in_flight: int = 0
    max_in_flight: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        behaviour = self.behaviours[len(self.bodies) % len(self.behaviours)]
        self.bodies.append(body)
        if behaviour == "http_error":
            return web.Response(status=503, text="overloaded")
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            return await self.stream(request, body, behaviour)
        finally:
            self.num_in_flight -= 1

    async def stream(
        self, request: web.Request, body: dict[str, Any], behaviour: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        is_chat = "messages" in body

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())
            await asyncio.sleep(0.001)  # let chunks arrive apart

        def chunk(text: str, finish_reason: str | None = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
            if is_chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            return {"choices": [choice]}

        if behaviour == "garbage":
            await send("not json")
            await send("[1, 2]")
            return response
        if behaviour == "hang":
            await asyncio.wait_for(self.release.wait(), timeout=30)
            return response
        if is_chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        else:
            await send(chunk(""))  # an empty first chunk: not a token, not the TTFT
        num_tokens = body["max_tokens"]
        for i in range(0, num_tokens, self.tokens_per_chunk):
            if behaviour == "error_event" and i >= 2 * self.tokens_per_chunk:
                await send({"error": {"message": "boom", "type": "InternalServerError"}})
                return response
            await send(chunk("t" * min(self.tokens_per_chunk, num_tokens - i)))
        await send(chunk("", finish_reason="length"))
        if self.send_usage:
            prompt = body.get("prompt", "")
            usage = {"prompt_tokens": len(prompt) + 1, "completion_tokens": num_tokens}
            await send({"choices": [], "usage": usage})
        if behaviour != "cut":
            await send("[DONE]")
        return response


@dataclass
class RunningServer:
    fake: FakeOpenAI
    base_url: str


@pytest.fixture
def start_fake() -> Iterator[Any]:
    """``start_fake(FakeOpenAI(...)) -> RunningServer`` on a free 127.0.0.1 port, in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners: list[tuple[web.AppRunner, FakeOpenAI]] = []

    async def start(fake: FakeOpenAI) -> RunningServer:
        fake.release = asyncio.Event()  # bound to the server's loop
        app = web.Application()
        app.router.add_post("/v1/completions", fake.handle)
        app.router.add_post("/v1/chat/completions", fake.handle)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append((runner, fake))
        host, port = runner.addresses[0][:2]
        return RunningServer(fake, f"http://{host}:{port}")

    yield lambda fake: asyncio.run_coroutine_threadsafe(start(fake), loop).result(timeout=10)

    async def stop() -> None:
        for runner, fake in runners:
            fake.release.set()
            await runner.cleanup()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def run_args(server: RunningServer, tokenizer_dir: Path, *extra: str) -> list[str]:
    return [
        "--base-url", server.base_url, "--model", "tiny", "--tokenizer", str(tokenizer_dir),
        "--num-prompts", "8", "--input-len", "16", "--output-len", "6", "--num-warmups", "0",
        "--disable-tqdm", "--request-timeout", "20", *extra,
    ]  # fmt: skip


def test_run_counts_successes_failures_and_usage_tokens(
    start_fake: Any, tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_fake(
        FakeOpenAI(["ok", "http_error", "ok", "error_event"], tokens_per_chunk=2, send_usage=True)
    )
    result_json, plot = tmp_path / "out" / "run.json", tmp_path / "out" / "run.png"
    args = [
        "--prompt-as-token-ids", "--request-rate", "200", "--seed", "3",
        "--goodput", "ttft:60000", "--result-json", str(result_json), "--plot", str(plot),
    ]  # fmt: skip
    assert serve.main(run_args(server, tiny_llama_dir, *args)) == 0

    result = json.loads(result_json.read_text())
    summary = result["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 4
    assert summary["errors"] == {"HTTP 503: overloaded": 2, "error event: boom": 2}
    assert summary["total_output_tokens"] == 4 * 6
    assert summary["total_input_tokens"] == 4 * (16 + 1)  # the server's usage counts
    assert summary["num_short_outputs"] == 0
    assert summary["request_goodput"] is not None
    assert result["config"]["request_rate"] == 200.0
    done = [r for r in result["requests"] if r["success"]]
    for record in done:
        assert record["num_output_tokens"] == 6 and record["is_output_from_usage"]
        assert record["num_content_chunks"] == 3  # two tokens a chunk; the empty one not counted
        assert len(record["itl_s"]) == 2
    assert sorted(r["index"] for r in result["requests"]) == list(range(8))
    assert plot.read_bytes().startswith(b"\x89PNG")

    for body in server.fake.bodies:
        assert body["max_tokens"] == body["min_tokens"] == 6 and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"]) == 16 and all(isinstance(t, int) for t in body["prompt"])
    assert re.search(r"^Successful requests: +4$", capsys.readouterr().out, re.MULTILINE)


def test_chat_without_usage_counts_content_chunks(start_fake: Any, tiny_llama_dir: Path) -> None:
    server = start_fake(FakeOpenAI(["ok"], tokens_per_chunk=1, send_usage=False))
    config = serve.LoadConfig(
        url=server.base_url + "/v1/chat/completions", model="tiny", show_progress=False
    )
    inputs = [serve.RequestInput("hello there", 2, 5) for _ in range(3)]
    records, duration = asyncio.run(serve.run_load(config, inputs))

    assert duration > 0 and len(server.fake.bodies) == 4  # one warm-up
    for record in records:
        assert record.success, record.error
        assert record.num_output_tokens == record.num_content_chunks == 5  # the role chunk is not
        assert not record.is_output_from_usage and len(record.itl_s) == 4
    assert server.fake.bodies[0]["messages"] == [{"role": "user", "content": "hello there"}]


def test_timeouts_and_broken_streams_are_failures_not_crashes(start_fake: Any) -> None:
    server = start_fake(FakeOpenAI(["hang", "cut", "garbage", "ok"]))
    config = serve.LoadConfig(
        url=server.base_url + "/v1/completions",
        model="tiny",
        request_timeout_s=1.0,
        num_warmups=0,
        show_progress=False,
    )
    records, _ = asyncio.run(serve.run_load(config, [serve.RequestInput([5, 6], 2, 3)] * 4))
    errors = sorted(r.error or "ok" for r in records)
    assert errors[0].startswith("JSONDecodeError: ")
    assert errors[1:] == ["ok", "stream ended before [DONE]", "timeout after 1 s"]


def test_max_concurrency_bounds_requests_in_flight(start_fake: Any) -> None:
    server = start_fake(FakeOpenAI(["ok"]))
    config = serve.LoadConfig(
        url=server.base_url + "/v1/completions",
        model="tiny",
        max_concurrency=2,
        num_warmups=0,
        show_progress=False,
    )
    records, _ = asyncio.run(serve.run_load(config, [serve.RequestInput([5], 1, 4)] * 8))
    assert all(r.success for r in records)
    assert server.fake.max_in_flight == 2


def test_a_run_whose_warm_up_fails_stops_with_an_error(
    start_fake: Any, tiny_llama_dir: Path
) -> None:
    server = start_fake(FakeOpenAI(["http_error"]))
    args = run_args(server, tiny_llama_dir, "--num-warmups", "1")
    assert serve.main(args) == 1
    assert len(server.fake.bodies) == 1  # the warm-up only: the run itself never started


def test_plot_compares_saved_runs(start_fake: Any, tiny_llama_dir: Path, tmp_path: Path) -> None:
    server = start_fake(FakeOpenAI(["ok"]))
    paths = []
    for label, rate in (("a", "inf"), ("a", "50"), ("b", "inf")):
        path = tmp_path / f"{label}-{rate}.json"
        args = ["--label", label, "--request-rate", rate, "--result-json", str(path)]
        assert serve.main(run_args(server, tiny_llama_dir, *args)) == 0
        paths.append(str(path))
    plot = tmp_path / "compare.png"
    assert serve.main(["plot", *paths, "--output", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    labels = [serve.load_result(Path(p))[0] for p in paths]
    assert labels == ["a", "a", "b"]


def test_a_server_that_is_not_there_fails_each_request() -> None:
    (port,) = free_ports(1)  # nothing listens on it
    config = serve.LoadConfig(
        url=f"http://127.0.0.1:{port}/v1/completions",
        model="tiny",
        num_warmups=0,
        show_progress=False,
    )
    records, _ = asyncio.run(serve.run_load(config, [serve.RequestInput([5], 1, 4)] * 3))
    assert [r.success for r in records] == [False] * 3
    assert all(r.error and r.error.startswith("ClientConnectorError") for r in records)
