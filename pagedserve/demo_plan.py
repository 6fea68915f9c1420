"""The demo's plan (pagedserve/demo.py): how big each phase of `pagedserve demo` is (`FULL`,
`QUICK`; `DemoPlan.check` makes sure the burst forces a preemption) and what it says: the
prompts, chat questions, tenants, their system prompts and their questions, and the beam
search's question."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    beam_width: int = 3  # step 4: one request with beam search
    beam_tokens: int = 24

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
    burst_requests=6, burst_prompt_tokens=192, burst_max_tokens=96, beam_tokens=8,
)
BEAM_QUESTION = "Suggest a name for a small coffee shop."

TENANTS = ("acme-bank", "globex-shipping", "initech-support", "umbrella-health",
           "hooli-search", "stark-energy")
QUESTIONS = ("How do I reset my password?", "Where is my parcel right now?",
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

