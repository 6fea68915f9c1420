"""The demo's workload (pagedserve/demo.py): `Workload` runs the phases of `pagedserve demo`
against a started cluster over gRPC (streamed answers, the multi-tenant shared prefixes, the
burst that forces a preemption, a beam search) and `run_workload` runs them all, prints the
summary and says what went wrong."""

from __future__ import annotations

import random
import sys
import time

from .demo_metrics import (
    PeakSampler,
    RequestRecord,
    describe_error,
    one_line,
    per_executor,
    printable,
    read_metrics,
    summary,
)
from .demo_plan import BEAM_QUESTION, QUESTIONS, TENANTS, DemoPlan, system_prompt


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
        tenants = TENANTS[:plan.num_tenants]
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
            q = QUESTIONS[(j * len(tenants) + tenants.index(t)) % len(QUESTIONS)]
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

    def phase_beams(self) -> None:
        """One request with beam search (README "Beam search"): its beams, best first."""
        width, question = self.plan.beam_width, BEAM_QUESTION
        self.say(f"\n== 4. beam search: {width} beams of one answer, best first (one request; "
                 "its beams share their KV blocks) ==")
        prompt = self.prompt(None, question) if self.chat is not None else question
        req = self.pb.GenerateRequest(prompt=prompt, params=self.pb.SamplingParams(
            max_tokens=self.plan.beam_tokens, n=width, beam_search=self.pb.BeamSearch()))
        self.say(f"\n> {question}")
        start = time.perf_counter()
        try:
            resp = self.stub.Generate(req, timeout=300)
        except Exception as exc:  # grpc.RpcError: said here
            self.say(f"  failed: {describe_error(exc)}")
            return
        for i, c in enumerate(resp.completions):
            rec = RequestRecord("beam", finish_reason=self.pb.FinishReason.Name(
                c.finish_reason), stop_token_id=c.stop_token_id
                if c.HasField("stop_token_id") else None)
            self.say(f"  {i + 1}. {printable(c.text).strip()}  [{len(c.token_ids)} tokens, "
                     f"{self.ending(rec)}]")
        self.say(f"  [{resp.usage.completion_tokens} tokens in "
                 f"{time.perf_counter() - start:.2f} s]")

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
        w.phase_beams()
        w.records = [r for r in w.records if r.phase != "stream"] + \
                    [r for r in w.records if r.phase == "stream"]
        lines, facts = summary(w, sampler, wall_s)
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

