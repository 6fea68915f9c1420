"""A deterministic "model" for beam search tests, served two ways: by `ContextExecutor`
(the executor's side of the router's step loop, in process: tests/pipeline_rig.py's
engine) and by `ContextLM` (a transformers model, so that `generate(num_beams=...)` is the
reference).

The logits of the next token are a pure function of the whole context (prompt + outputs):
a random vector seeded by the context's hash, with the EOS logit raised by `eos_boost`
so that beams end now and then (or often). Both sides take torch's float32 log-softmax of the same
logits, so their logprobs agree to the bit and any difference in tokens is the search's.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from pagedserve.protos import wire
from pipeline_rig import EOS, VOCAB, SimExecutor
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


def context_logits(context, eos_boost: float = 2.0, spread: float = 3.0) -> torch.Tensor:
    """float32 [VOCAB] logits after `context` (a sequence of token ids)."""
    key = hashlib.sha256(np.asarray(context, np.int64).tobytes()).digest()
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    logits = rng.standard_normal(VOCAB).astype(np.float32) * np.float32(spread)
    logits[EOS] += np.float32(eos_boost)
    return torch.from_numpy(logits)


class ContextConfig(PretrainedConfig):
    model_type = "pagedserve_context_lm"

    def __init__(self, vocab_size: int = VOCAB, eos_boost: float = 2.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.eos_boost = eos_boost


class ContextLM(PreTrainedModel, GenerationMixin):
    """transformers' side: logits of the last position of every row (no KV cache)."""

    config_class = ContextConfig

    def __init__(self, config: ContextConfig) -> None:
        super().__init__(config)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # (generate reads a device)

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        rows = [context_logits(row.tolist(), self.config.eos_boost) for row in input_ids]
        return CausalLMOutputWithPast(logits=torch.stack(rows)[:, None, :])


def hf_beams(prompt: list[int], width: int, max_tokens: int, *, stop_ids=(EOS,),
             length_penalty: float = 1.0, early_stopping=False, min_tokens: int = 0,
             eos_boost: float = 2.0) -> list[list[int]]:
    """transformers' beam search outputs (best first), each cut after its stop id."""
    model = ContextLM(ContextConfig(eos_boost=eos_boost))
    out = model.generate(
        torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
        max_new_tokens=max_tokens, do_sample=False, use_cache=False,
        eos_token_id=list(stop_ids) or None, pad_token_id=0, length_penalty=length_penalty,
        early_stopping=early_stopping, min_new_tokens=min_tokens or None,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    beams = []
    for row in out[:, len(prompt):].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_ids), None)
        beams.append(row[: cut + 1] if cut is not None else row)
    return beams


class ContextExecutor(SimExecutor):
    """The executor's side for `pipeline_rig`'s engine (its `SimExecutor`, answering with
    this model): keeps every request's context from the plans (new requests' tokens, rows'
    inputs by position, forks) and answers each sampling row with the greedy token and the
    top-k its request asks for; a marked decode is fed the token it sampled for the
    request in the step before. Checks what a real executor relies on: a row starts where
    the request's computed tokens end (or before: a recompute), a fork's parent is known, a
    new request is new."""

    def __init__(self, engine, executor_id: str = "e0", eos_boost: float = 2.0) -> None:
        super().__init__(engine, executor_id)
        self.eos_boost = eos_boost
        self.ctx: dict[str, list[int]] = {}
        self.k: dict[str, int | None] = {}
        self.new_requests: list[wire.NewRequest] = []
        self.forked: list[str] = []  # children of the plans' forks
        self.dropped: list[str] = []

    def result_for(self, plan: wire.StepPlan) -> wire.StepResult:
        for rid in plan.finished_ids:
            self.ctx.pop(rid)
            self.dropped.append(rid)
        for req in plan.new_requests:
            assert req.request_id not in self.ctx, req.request_id
            self.new_requests.append(req)
            self.ctx[req.request_id] = [*req.prompt_token_ids.tolist(),
                                        *req.output_token_ids.tolist()]
            self.k[req.request_id] = req.sampling.logprobs
        for fork in plan.forks:  # (an unknown parent or a known child fails the test)
            assert fork.child_id not in self.ctx, fork.child_id
            self.ctx[fork.child_id] = list(self.ctx[fork.parent_id])
            self.k[fork.child_id] = self.k[fork.parent_id]
            self.forked.append(fork.child_id)
        ids, tokens, lps, counts, top_ids, top_lps = [], [], [], [], [], []
        first = 0
        for i, rid in enumerate(plan.request_ids):
            n = int(plan.num_new_tokens[i])
            start = int(plan.num_computed_tokens[i])
            row = plan.token_ids[first:first + n].tolist()
            assert int(plan.positions[first]) == start
            first += n
            if plan.feed_sampled is not None and plan.feed_sampled[i]:  # its own sample
                assert row == [-1] and self.last[rid][0] == plan.step_id - 1, rid
                row = [self.last[rid][1]]
            ctx = self.ctx[rid]
            assert start <= len(ctx), (rid, start, len(ctx))
            ctx[start:start + n] = row
            if not plan.do_sample[i]:
                continue
            lp = torch.log_softmax(context_logits(ctx[:start + n], self.eos_boost), -1)
            tok = int(lp.argmax())
            self.last[rid] = (plan.step_id, tok)
            ids.append(rid)
            tokens.append(tok)
            lps.append(float(lp[tok]))
            k = self.k[rid] or 0
            counts.append(k)
            if k:
                top = lp.topk(k)
                top_ids += top.indices.tolist()
                top_lps += top.values.tolist()
        return wire.StepResult(
            step_id=plan.step_id, executor_id=self.id, request_ids=ids,
            token_ids=np.array(tokens, np.int32), logprobs=np.array(lps, np.float32),
            top_counts=np.array(counts, np.int32), top_token_ids=np.array(top_ids, np.int32),
            top_logprobs=np.array(top_lps, np.float32), forward_s=1e-3)
