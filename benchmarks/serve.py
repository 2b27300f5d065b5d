"""Serving benchmark: load any OpenAI-compatible server (pdserve's gateway, vLLM) over HTTP/SSE.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model MODEL [--tokenizer DIR]
        [--endpoint /v1/completions] [--num-prompts 64] [--input-len 256] [--output-len 64]
        [--shared-prefix-len 0 --num-prefixes 1] [--prompt-as-token-ids]
        [--request-rate inf [--burstiness 1.0]] [--max-concurrency C] [--seed 0]
        [--goodput ttft:2000 tpot:100] [--label NAME]
        [--result-json OUT.json] [--plot OUT.png [--compare A.json B.json ...]]
    python benchmarks/serve.py plot A.json B.json ... --output OUT.png

The conventions are those of ``vllm bench serve``, so the two can be pointed at the same server
and compared:

- Prompts are random token ids (the tokenizer's special tokens excluded), sent as text decoded by
  the model's tokenizer (re-encoded and adjusted until it encodes to ``--input-len`` tokens), or
  as the ids themselves with ``--prompt-as-token-ids``. With ``--shared-prefix-len P`` every
  prompt starts with one of ``--num-prefixes`` random prefixes of ``P`` tokens; ``--input-len``
  counts the prefix. Every request asks for exactly ``--output-len`` tokens (``max_tokens``,
  ``min_tokens`` and ``ignore_eos``), streamed with ``stream_options.include_usage``.
- Arrivals: a Poisson process at ``--request-rate`` requests/s (gamma-distributed gaps when
  ``--burstiness`` is not 1), from ``--seed``; ``inf`` sends them all at once (a burst).
  ``--max-concurrency`` caps the requests in flight either way.
- Per request: TTFT is the time to the first chunk that carries text or token ids (an empty
  first chunk is not a token); ITL are the gaps between such chunks; e2e runs to the end of the
  stream; TPOT = (e2e - TTFT) / (output tokens - 1), for requests with more than one token.
  Output tokens come from the usage chunk, or are the number of content chunks if the server
  sends none. Goodput is completed requests per second that meet every ``--goodput`` SLO (ms).
- A failed request (HTTP status, error event, timeout, broken stream) is recorded with its
  error and counted; it never stops the run. Every request is bounded by ``--request-timeout``.

Only loopback addresses are loaded unless ``--allow-remote``: a benchmark pointed at a shared
server by mistake is a denial of service.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import ipaddress
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from tqdm import tqdm

logger = logging.getLogger(__name__)

SLO_METRICS = ("ttft", "tpot", "e2el")  # --goodput keys, as vllm bench serve names them
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
STAT_NAMES = ("mean", "median", "p90", "p99")
MAX_ERROR_CHARS = 300


# --------------------------------------------------------------------------------------------
# Requests and their records


@dataclass(frozen=True)
class RequestInput:
    """One request of the workload."""

    prompt: str | list[int]
    prompt_len: int  # tokens, as built here; the server's usage count replaces it when sent
    output_len: int  # tokens asked for (max_tokens = min_tokens)


@dataclass
class RequestRecord:
    """What one request measured. Times in seconds."""

    index: int
    prompt_len: int  # from the server's usage when it reports one
    output_len: int  # asked for
    success: bool = False
    error: str | None = None
    start_s: float = 0.0  # when it was sent, from the start of the run
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # [num_content_chunks - 1]
    num_content_chunks: int = 0
    num_output_tokens: int = 0  # usage.completion_tokens, else num_content_chunks
    is_output_from_usage: bool = False


def tpot_s(record: RequestRecord) -> float | None:
    """(e2e - TTFT) / (output tokens - 1); None when it is undefined (fewer than 2 tokens)."""
    if not record.success or record.num_output_tokens < 2:
        return None
    assert record.ttft_s is not None and record.e2el_s is not None
    return (record.e2el_s - record.ttft_s) / (record.num_output_tokens - 1)


# --------------------------------------------------------------------------------------------
# Metrics: pure functions of records


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, p90, p99 (numpy's linear interpolation, as vLLM); None for no values."""
    if not values:
        return dict.fromkeys(STAT_NAMES)
    array = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"mean": float(array.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO; TPOT binds only requests with 2+ tokens."""
    if not record.success:
        return False
    measured_s = {"ttft": record.ttft_s, "tpot": tpot_s(record), "e2el": record.e2el_s}
    for name, limit_ms in slos_ms.items():
        value = measured_s[name]
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


def run_names(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Each run's label, with its traffic added where several runs share a label."""
    labels = Counter(label for label, _ in runs)
    names = []
    for label, result in runs:
        if labels[label] > 1:
            config = result["config"]
            rate = float(config["request_rate"])
            label += " @ burst" if math.isinf(rate) else f" @ {rate:g} req/s"
            if config.get("max_concurrency"):
                label += f", <= {config['max_concurrency']} in flight"
        names.append(label)
    return names


def latencies_ms(records: Sequence[RequestRecord], metric: str) -> list[float]:
    """One metric's values (ms) over the completed requests; ITL pools every request's gaps."""
    done = [r for r in records if r.success]
    if metric == "ttft":
        return [r.ttft_s * 1000.0 for r in done if r.ttft_s is not None]
    if metric == "tpot":
        return [t * 1000.0 for r in done if (t := tpot_s(r)) is not None]
    if metric == "itl":
        return [gap * 1000.0 for r in done for gap in r.itl_s]
    assert metric == "e2el", metric
    return [r.e2el_s * 1000.0 for r in done if r.e2el_s is not None]


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None
) -> dict[str, Any]:
    """The run's summary, flat and keyed as vllm bench serve's JSON (latencies in ms)."""
    assert duration_s > 0, duration_s
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.num_output_tokens for r in done)
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "request_goodput": None,
        # ignore_eos not honoured, or a stream cut short without an error
        "num_short_outputs": sum(r.num_output_tokens < r.output_len for r in done),
        "errors": dict(Counter(r.error for r in failed).most_common()),
    }
    if slos_ms:
        summary["request_goodput"] = sum(meets_slos(r, slos_ms) for r in done) / duration_s
    for metric in LATENCY_METRICS:
        for stat, value in distribution(latencies_ms(done, metric)).items():
            summary[f"{stat}_{metric}_ms"] = value
    return summary


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:100"]`` -> ``{"ttft": 2000.0, "tpot": 100.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {item!r} is not NAME:MS with NAME in {SLO_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of ms") from None
        if not slos[name] > 0:
            raise ValueError(f"goodput SLO {item!r} must be positive")
    return slos


# --------------------------------------------------------------------------------------------
# Workload: prompts and arrivals


def arrival_offsets(
    num: int, request_rate: float, seed: int, burstiness: float = 1.0
) -> list[float]:
    """Send times (s from the start) of ``num`` requests; the first goes at once.

    Gaps are gamma-distributed with mean 1 / rate and shape ``burstiness`` (1 = Poisson
    arrivals; lower is burstier); an infinite rate sends everything at 0.
    """
    if not request_rate > 0:
        raise ValueError(f"request rate must be positive or inf, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(num):
        if i > 0:
            now += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        offsets.append(now)
    return offsets


def prompt_token_pool(tokenizer: Any) -> list[int]:
    """Token ids a random prompt may use: those that decode to text on their own.

    Special tokens are left out, and so are byte tokens of partial UTF-8 characters (they decode
    to U+FFFD, which encodes back to three tokens, so prompt lengths would never fit).
    """
    special = set(tokenizer.get_added_tokens_decoder())
    ids = [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in special]
    texts = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    return [i for i, text in zip(ids, texts, strict=True) if text and "\ufffd" not in text]


def random_token_prompts(
    num: int,
    input_len: int,
    pool: Sequence[int],
    seed: int,
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
) -> list[list[int]]:
    """``num`` prompts of ``input_len`` ids; prompt i opens with prefix ``i % num_prefixes``."""
    if not 0 <= shared_prefix_len <= input_len:
        raise ValueError(f"shared prefix of {shared_prefix_len} tokens, input_len is {input_len}")
    rng = random.Random(seed)
    prefixes = [rng.choices(pool, k=shared_prefix_len) for _ in range(max(num_prefixes, 1))]
    return [
        prefixes[i % len(prefixes)] + rng.choices(pool, k=input_len - shared_prefix_len)
        for i in range(num)
    ]


def fit_text(
    tokenizer: Any, ids: list[int], pool: Sequence[int], rng: random.Random, max_rounds: int = 10
) -> tuple[str, int]:
    """Text that encodes to ``len(ids)`` tokens, from the decoded ids; returns (text, length).

    Decoding random ids and encoding the text again rarely gives the same count (BPE merges
    across the ids' boundaries), so re-encode, cut or pad, and repeat.
    """
    target, text, num = len(ids), "", 0
    for _ in range(max_rounds):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        encoded = tokenizer.encode(text, add_special_tokens=False).ids
        num = len(encoded)
        if num == target:
            break
        ids = encoded[:target] + rng.choices(pool, k=max(target - num, 0))
    return text, num


def build_inputs(
    args: argparse.Namespace, tokenizer: Any, token_prompts: list[list[int]], pool: Sequence[int]
) -> list[RequestInput]:
    if args.prompt_as_token_ids:
        return [RequestInput(ids, len(ids), args.output_len) for ids in token_prompts]
    rng = random.Random(args.seed + 1)
    prefix_texts: dict[int, tuple[str, int]] = {}
    inputs = []
    for i, ids in enumerate(token_prompts):
        prefix_len = args.shared_prefix_len
        if prefix_len:
            key = i % args.num_prefixes
            if key not in prefix_texts:
                prefix_texts[key] = fit_text(tokenizer, ids[:prefix_len], pool, rng)
            prefix, num_prefix = prefix_texts[key]
        else:
            prefix, num_prefix = "", 0
        suffix, num_suffix = fit_text(tokenizer, ids[prefix_len:], pool, rng)
        # NOTE: BPE may merge across the seam, so the length is approximate by a token or so.
        inputs.append(RequestInput(prefix + suffix, num_prefix + num_suffix, args.output_len))
    return inputs


def load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


# --------------------------------------------------------------------------------------------
# The client


def is_local_url(url: str) -> bool:
    """Whether ``url`` names a loopback host (localhost, 127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it could resolve anywhere
        return False


@dataclass(frozen=True)
class LoadConfig:
    """How requests are sent; the workload itself is a list of RequestInput."""

    url: str  # the endpoint's full URL
    model: str  # the "model" field of each request
    request_rate: float = math.inf  # requests/s; inf = all at once
    burstiness: float = 1.0  # shape of the gamma gaps; 1 = Poisson
    max_concurrency: int | None = None  # requests in flight at most; None = unbounded
    seed: int = 0
    request_timeout_s: float = 600.0  # whole request, stream included
    num_warmups: int = 1  # requests sent and awaited first, not measured
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive or inf, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request timeout must be positive, got {self.request_timeout_s}")

    @property
    def is_chat(self) -> bool:
        return self.url.rstrip("/").endswith("/chat/completions")


def request_body(config: LoadConfig, request: RequestInput) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "min_tokens": request.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.is_chat:
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint takes text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    body.update(config.extra_body)
    return body


class SseDecoder:
    """Bytes of a ``text/event-stream`` in, the ``data`` payload of each complete event out."""

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")()  # a character may span reads
        self._line = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        events = []
        *lines, self._line = (self._line + self._text.decode(chunk)).split("\n")
        for line in lines:
            line = line.removesuffix("\r")
            if not line:  # a blank line ends the event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return events


class StreamError(Exception):
    """The server reported an error, or the stream broke, after answering 200."""


def chunk_error(chunk: dict[str, Any]) -> str | None:
    """The message of an error event (``{"error": {...}}`` or vLLM's ``{"object": "error"}``)."""
    error = chunk.get("error")
    if error:
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    if chunk.get("object") == "error":
        return str(chunk.get("message", chunk))
    return None


def has_content(chunk: dict[str, Any]) -> bool:
    """Whether a chunk carries generated text or token ids (a role-only chunk does not)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if (
            choice.get("text")
            or choice.get("token_ids")
            or delta.get("content")
            or delta.get("reasoning_content")
        ):
            return True
    return False


async def send_request(
    session: aiohttp.ClientSession,
    config: LoadConfig,
    request: RequestInput,
    index: int,
    run_start: float,
) -> RequestRecord:
    """Send one streaming request and measure it; every failure ends in the record, not raised."""
    record = RequestRecord(index, request.prompt_len, request.output_len)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    body = request_body(config, request)
    start = time.perf_counter()
    record.start_s = start - run_start
    last = start
    try:
        async with asyncio.timeout(config.request_timeout_s):
            # No redirects: a local server must not send our traffic anywhere else.
            async with session.post(
                config.url, json=body, headers=headers, allow_redirects=False
            ) as response:
                if response.status != 200:
                    text = (await response.text(errors="replace")).strip()
                    raise StreamError(f"HTTP {response.status}: {text[:MAX_ERROR_CHARS]}")
                decoder, is_done = SseDecoder(), False
                async for data in response.content.iter_any():
                    now = time.perf_counter()  # events of one read arrived together
                    for payload in decoder.feed(data):
                        if payload == "[DONE]":
                            is_done = True
                            continue
                        chunk = json.loads(payload)
                        if not isinstance(chunk, dict):
                            raise StreamError(f"not a JSON object: {payload[:MAX_ERROR_CHARS]}")
                        if (message := chunk_error(chunk)) is not None:
                            raise StreamError(f"error event: {message[:MAX_ERROR_CHARS]}")
                        if usage := chunk.get("usage"):
                            record.prompt_len = usage.get("prompt_tokens", record.prompt_len)
                            if "completion_tokens" in usage:
                                record.num_output_tokens = usage["completion_tokens"]
                                record.is_output_from_usage = True
                        if has_content(chunk):
                            if record.ttft_s is None:
                                record.ttft_s = now - start
                            else:
                                record.itl_s.append(now - last)
                            last = now
                            record.num_content_chunks += 1
                if not is_done:
                    raise StreamError("stream ended before [DONE]")
                if record.ttft_s is None:
                    raise StreamError("stream carried no content")
        record.e2el_s = time.perf_counter() - start
        if not record.is_output_from_usage:
            record.num_output_tokens = record.num_content_chunks
        record.success = True
    except StreamError as e:
        record.error = str(e)
    except TimeoutError:
        record.error = f"timeout after {config.request_timeout_s:g} s"
    # A refused connection, a malformed chunk: this request fails, never the run.
    except Exception as e:
        record.error = f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
    return record


async def run_load(
    config: LoadConfig, inputs: Sequence[RequestInput]
) -> tuple[list[RequestRecord], float]:
    """Send ``inputs`` as configured; returns their records (in input order) and the duration.

    The duration runs from the first send to the last request's end. Warm-up requests go
    first and are not counted; if every one fails the run stops with RuntimeError.
    """
    offsets = arrival_offsets(len(inputs), config.request_rate, config.seed, config.burstiness)
    # limit=0: aiohttp's default pool of 100 connections would queue a burst silently.
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    # trust_env=False: no proxy from the environment may carry loopback traffic elsewhere.
    # No session timeout: aiohttp's default (300 s in all) cut long bursts off and was reported
    # as a --request-timeout expiry; each request's own bound is --request-timeout.
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        connector=connector, trust_env=False, timeout=timeout
    ) as session:
        if config.num_warmups and inputs:
            warmups = await asyncio.gather(
                *(
                    send_request(session, config, inputs[0], -1, time.perf_counter())
                    for _ in range(config.num_warmups)
                )
            )
            if not any(w.success for w in warmups):
                raise RuntimeError(f"every warm-up request failed: {warmups[0].error}")

        limit = (
            asyncio.Semaphore(config.max_concurrency)
            if config.max_concurrency
            else contextlib.nullcontext()
        )
        progress = tqdm(total=len(inputs), disable=not config.show_progress, unit="req")
        run_start = time.perf_counter()

        async def one(index: int, request: RequestInput, offset: float) -> RequestRecord:
            delay = run_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                record = await send_request(session, config, request, index, run_start)
            progress.update(1)
            return record

        tasks = (one(i, r, t) for i, (r, t) in enumerate(zip(inputs, offsets, strict=True)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - run_start
        progress.close()
    return records, duration


# --------------------------------------------------------------------------------------------
# Output: table, JSON, plots


def format_summary(summary: dict[str, Any], slos_ms: dict[str, float] | None = None) -> str:
    def line(name: str, value: Any, fmt: str = ".2f") -> str:
        text = "n/a" if value is None else format(value, fmt)
        return f"{name:<40}{text}"

    rows = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        line("Successful requests:", summary["completed"], "d"),
        line("Failed requests:", summary["failed"], "d"),
        line("Benchmark duration (s):", summary["duration"]),
        line("Total input tokens:", summary["total_input_tokens"], "d"),
        line("Total generated tokens:", summary["total_output_tokens"], "d"),
        line("Request throughput (req/s):", summary["request_throughput"]),
    ]
    if slos_ms:
        rows.append(line("Request goodput (req/s):", summary["request_goodput"]))
    rows += [
        line("Output token throughput (tok/s):", summary["output_throughput"]),
        line("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for metric in LATENCY_METRICS:
        rows.append("{s:{c}^50}".format(s=METRIC_TITLES[metric], c="-"))
        for stat in STAT_NAMES:
            name = f"{stat.title()} {metric.upper()} (ms):"
            rows.append(line(name, summary[f"{stat}_{metric}_ms"]))
    rows.append("=" * 50)
    if summary["num_short_outputs"]:
        rows.append(f"{summary['num_short_outputs']} completed requests had fewer output tokens")
        rows.append("than asked for: the server ignored ignore_eos, or cut streams short.")
    for error, count in list(summary["errors"].items())[:5]:
        rows.append(f"failed x{count}: {error}")
    return "\n".join(rows)


def run_label(result: dict[str, Any], path: Path | None = None) -> str:
    label = result["config"].get("label")
    if label:
        return str(label)
    return path.stem if path else "this run"


def plot_results(runs: Sequence[tuple[str, dict[str, Any]]], path: Path) -> None:
    """Latency CDFs of each run; with several runs, throughput vs rate and comparison bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    is_compare = len(runs) > 1
    fig, axes = plt.subplots(2 if is_compare else 1, 4, figsize=(20, 9 if is_compare else 4.5))
    cdf_axes = axes[0] if is_compare else axes
    names = run_names(runs)
    for ax, metric in zip(cdf_axes, LATENCY_METRICS, strict=True):
        for name, (_, result) in zip(names, runs, strict=True):
            records = [RequestRecord(**r) for r in result["requests"]]
            values = np.sort(np.asarray(latencies_ms(records, metric)))
            if values.size:
                fraction = np.arange(1, values.size + 1) / values.size
                ax.step(values, fraction, where="post", label=name)
        ax.set(title=f"{METRIC_TITLES[metric]} CDF", xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
    cdf_axes[0].legend(fontsize="small")

    if is_compare:
        plot_throughput_vs_rate(axes[1][0], runs)
        labels = names
        summaries = [result["summary"] for _, result in runs]
        bars(axes[1][1], labels, {"output": [s["output_throughput"] for s in summaries]}, "tok/s")
        axes[1][1].set_title("Output token throughput")
        for ax, metric in ((axes[1][2], "ttft"), (axes[1][3], "tpot")):
            series = {
                stat: [s[f"{stat}_{metric}_ms"] for s in summaries] for stat in ("median", "p99")
            }
            bars(ax, labels, series, "ms")
            ax.set_title(f"{metric.upper()} median and p99")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput_vs_rate(ax: Any, runs: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Output throughput against offered request rate, one line per label; inf drawn last."""
    rates = [float(result["config"]["request_rate"]) for _, result in runs]
    finite = [r for r in rates if math.isfinite(r)]
    inf_x = max(finite) * 1.25 if finite else 1.0
    by_label: dict[str, list[tuple[float, float]]] = {}
    for (label, result), rate in zip(runs, rates, strict=True):
        x = rate if math.isfinite(rate) else inf_x
        by_label.setdefault(label, []).append((x, result["summary"]["output_throughput"]))
    for label, points in by_label.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    if len(finite) < len(rates):
        ticks = sorted(set(finite)) + [inf_x]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + ["inf"])
    ax.set(title="Output throughput vs request rate", xlabel="request rate (req/s)")
    ax.set_ylabel("tok/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def bars(ax: Any, labels: Sequence[str], series: dict[str, list[float | None]], unit: str) -> None:
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [v or 0.0 for v in values], width, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize="small")
    ax.set_ylabel(unit)
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:
        ax.legend(fontsize="small")


def load_result(path: Path) -> tuple[str, dict[str, Any]]:
    result = json.loads(path.read_text())
    return run_label(result, path), result


# --------------------------------------------------------------------------------------------
# Command line


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be positive or inf, got {text}")
    return rate


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="`serve.py plot A.json B.json ... --output OUT.png` plots saved results.",
    )
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    target.add_argument("--model", required=True, help="the model name the server serves")
    target.add_argument("--api-key", help="sent as a bearer token")
    target.add_argument("--allow-remote", action="store_true", help="load a non-loopback host")
    target.add_argument("--request-timeout", type=float, default=600.0, help="s per request")
    target.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into bodies")

    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--tokenizer", type=Path, help="dir with tokenizer.json (default: --model)"
    )
    workload.add_argument("--num-prompts", type=int, default=64)
    workload.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    workload.add_argument("--output-len", type=int, default=64, help="output tokens, exactly")
    workload.add_argument("--shared-prefix-len", type=int, default=0, help="in --input-len")
    workload.add_argument("--num-prefixes", type=int, default=1)
    workload.add_argument("--prompt-as-token-ids", action="store_true")
    workload.add_argument("--seed", type=int, default=0)

    traffic = parser.add_argument_group("traffic")
    traffic.add_argument("--request-rate", type=parse_rate, default=math.inf, help="req/s or inf")
    traffic.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson")
    traffic.add_argument("--max-concurrency", type=int)
    traffic.add_argument("--num-warmups", type=int, default=1)

    report = parser.add_argument_group("results")
    report.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS")
    report.add_argument("--label", help="this run's name in comparison plots")
    report.add_argument("--result-json", type=Path)
    report.add_argument("--plot", type=Path, help="PNG of the latency CDFs")
    report.add_argument("--compare", type=Path, nargs="+", default=[], help="results to plot too")
    report.add_argument("--disable-tqdm", action="store_true")
    return parser


def plot_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="serve.py plot", description=plot_results.__doc__)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    plot_results([load_result(p) for p in args.results], args.output)
    print(f"wrote {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    parser = run_parser()
    args = parser.parse_args(argv)
    url = args.base_url.rstrip("/") + args.endpoint
    if not (args.allow_remote or is_local_url(url)):
        parser.error(f"{url} is not a loopback address (pass --allow-remote to load it anyway)")
    try:
        slos = parse_goodput(args.goodput)
        config = LoadConfig(
            url=url,
            model=args.model,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            request_timeout_s=args.request_timeout,
            num_warmups=args.num_warmups,
            api_key=args.api_key,
            extra_body=args.extra_body,
            show_progress=not args.disable_tqdm,
        )
        tokenizer = load_tokenizer(args.tokenizer or Path(args.model))
        pool = prompt_token_pool(tokenizer)
        token_prompts = random_token_prompts(
            args.num_prompts,
            args.input_len,
            pool,
            args.seed,
            args.shared_prefix_len,
            args.num_prefixes,
        )
        inputs = build_inputs(args, tokenizer, token_prompts, pool)
        if config.is_chat and args.prompt_as_token_ids:
            raise ValueError("--prompt-as-token-ids needs the completions endpoint")
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))

    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g} req/s"
    logger.info(
        "%d requests of %d -> %d tokens to %s; rate %s, burstiness %g, max concurrency %s",
        len(inputs), args.input_len, args.output_len, url, rate, config.burstiness,
        config.max_concurrency,
    )  # fmt: skip
    try:
        records, duration = asyncio.run(run_load(config, inputs))
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    summary = summarize(records, duration, slos)
    print(format_summary(summary, slos))

    run_config = {
        key: (str(value) if isinstance(value, Path) else value)
        for key, value in vars(args).items()
        if key not in ("api_key", "compare")
    }
    run_config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    run_config["url"] = url
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": run_config,
        "summary": summary,
        "requests": [asdict(r) for r in records],
    }
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=1, allow_nan=False))
        logger.info("wrote %s", args.result_json)
    if args.plot:
        runs = [(run_label(result, args.result_json), result)]
        runs += [load_result(p) for p in args.compare]
        plot_results(runs, args.plot)
        logger.info("wrote %s", args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
