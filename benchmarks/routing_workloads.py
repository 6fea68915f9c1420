"""The routing simulator's workloads (benchmarks/routing_sim.py): tenants with a system prompt
each, as single requests (uniform or Zipf-popular tenants), bursts of siblings, or multi-turn
chats; `build_arrivals` turns one into its seeded arrivals."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

VOCAB = 32000
EOS = VOCAB - 1  # never sampled by the fake (requests ignore EOS anyway)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    """Tenants with a system prompt each; `kind`: `poisson` (single requests, tenants drawn
    uniformly or by Zipf), `bursty` (a tenant sends `burst` requests at one instant, bursts
    Poisson) or `chat` (multi-turn: each turn's prompt is the last prompt + its output + a
    new user message; the next turn comes `think_s` (exponential mean) after the answer)."""

    name: str
    num_executors: int
    tenants: int
    num_requests: int  # chat: number of chats
    rate_per_executor: float  # requests/s per executor (chat: chats/s per executor)
    kind: str = "poisson"
    prefix_len: int = 1024
    question_len: tuple[int, int] = (32, 128)
    output_len: tuple[int, int] = (16, 64)
    num_gpu_blocks: int = 1024
    zipf_s: float = 0.0  # 0: uniform tenants
    burst: int = 1
    turns: tuple[int, int] = (3, 6)
    think_s: float = 1.0
    cap_factor: float = 0.0  # tenants' prefixes / one executor's cache (for the record)

    @property
    def fits_cluster(self) -> bool:
        """What must stay cached fits in the cluster's cache with room left for the running
        requests: `working_set_blocks` < 3/4 of all device blocks."""
        return self.working_set_blocks < 0.75 * self.num_executors * self.num_gpu_blocks

    @property
    def working_set_blocks(self) -> int:
        """Every tenant's prefix; for chats, the contexts of the chats alive at once: chats
        per second x mean turns x think time (a lower bound of a chat's life) x the mean
        final context (system prompt + every turn's message and answer)."""
        if self.kind != "chat":
            return self.tenants * -(-self.prefix_len // BLOCK_SIZE)
        turns = sum(self.turns) / 2
        live = self.rate_per_executor * self.num_executors * turns * self.think_s
        context = self.prefix_len + turns * (sum(self.question_len) + sum(self.output_len)) / 2
        return int(live * context / BLOCK_SIZE)


def _uniform(tenants_per_executor_cache: float, num_executors: int, per_tenant: int,
             name: str, rate: float = 10.0) -> Workload:
    per_exec = 1024 // 64  # prefixes one executor caches: 1,024 blocks / 64-block prefixes
    tenants = int(tenants_per_executor_cache * per_exec)
    return Workload(name=name, num_executors=num_executors, tenants=tenants,
                    num_requests=tenants * per_tenant, rate_per_executor=rate,
                    cap_factor=tenants_per_executor_cache)


# One executor caches 1,024 blocks (16,384 tokens) = 16 tenant prefixes of 1,024 tokens.
# Rates: 10 requests/s per executor (a cache hit costs the executor ~5 ms of prefill, a
# miss ~65 ms more, decode 16-64 tokens at 3.8 ms + 0.28 ms/row per step).
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    _uniform(0.5, 2, 24, "uniform-0.5x-e2"),
    _uniform(1, 2, 16, "uniform-1x-e2"),
    _uniform(2, 2, 10, "uniform-2x-e2"),
    _uniform(4, 2, 6, "uniform-4x-e2"),
    _uniform(2, 4, 10, "uniform-2x-e4"),
    _uniform(4, 8, 8, "uniform-4x-e8"),
    _uniform(8, 8, 5, "uniform-8x-e8"),
    Workload(name="zipf-3x-e4", num_executors=4, tenants=48, num_requests=480,
             rate_per_executor=10.0, zipf_s=1.2, cap_factor=3.0),
    Workload(name="bursty-2x-e4", num_executors=4, tenants=32, num_requests=384,
             rate_per_executor=10.0, kind="bursty", burst=8, cap_factor=2.0),
    Workload(name="chat-e2", num_executors=2, tenants=8, num_requests=100,
             rate_per_executor=1.5, kind="chat", prefix_len=512, question_len=(32, 128),
             output_len=(32, 96), cap_factor=0.25),
    Workload(name="chat-e8", num_executors=8, tenants=16, num_requests=240,
             rate_per_executor=1.5, kind="chat", prefix_len=512, question_len=(32, 128),
             output_len=(32, 96), cap_factor=0.5),
)}

QUICK_WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload(name="quick-2x-e2", num_executors=2, tenants=8, num_requests=40,
             rate_per_executor=4.0, prefix_len=256, num_gpu_blocks=64, cap_factor=2.0),
    Workload(name="quick-chat-e2", num_executors=2, tenants=2, num_requests=8,
             rate_per_executor=2.0, kind="chat", prefix_len=128, output_len=(8, 24),
             num_gpu_blocks=96, turns=(2, 3), think_s=0.2, cap_factor=0.1),
)}


@dataclass
class Turn:
    """A request to send: at `t` (chats: computed when the previous turn ends)."""

    t: float
    request_id: str
    prompt: list[int]  # chats: the new user message only, the history is added on arrival
    max_tokens: int
    chat: Chat | None = None
    tenant: int = 0  # chats: the chat's id


@dataclass
class Chat:
    system: list[int]
    messages: list[list[int]]  # user messages, one per turn
    outputs: list[int]  # max_tokens per turn
    think_s: list[float]
    history: list[int] = field(default_factory=list)
    next_turn: int = 0
    chat_id: int = 0


def build_arrivals(w: Workload, seed: int) -> tuple[list[Turn], list[Chat]]:
    """The workload's first arrivals (all of them but later chat turns), seeded."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, EOS, w.prefix_len).tolist() for _ in range(w.tenants)]
    rate = w.rate_per_executor * w.num_executors
    if w.zipf_s > 0:
        weights = 1.0 / np.arange(1, w.tenants + 1) ** w.zipf_s
        weights /= weights.sum()
    else:
        weights = np.full(w.tenants, 1.0 / w.tenants)

    def question() -> list[int]:
        return rng.integers(1, EOS, int(rng.integers(w.question_len[0],
                                                     w.question_len[1] + 1))).tolist()

    def out_len() -> int:
        return int(rng.integers(w.output_len[0], w.output_len[1] + 1))

    turns: list[Turn] = []
    chats: list[Chat] = []
    t = 0.0
    if w.kind == "chat":
        for c in range(w.num_requests):
            t += float(rng.exponential(1.0 / rate))
            tenant = int(rng.choice(w.tenants, p=weights))
            n = int(rng.integers(w.turns[0], w.turns[1] + 1))
            chat = Chat(system=systems[tenant], messages=[question() for _ in range(n)],
                        outputs=[out_len() for _ in range(n)],
                        think_s=[float(rng.exponential(w.think_s)) for _ in range(n)],
                        chat_id=c)
            chats.append(chat)
            turns.append(Turn(t, f"c{c}.0", [], chat.outputs[0], chat, c))
        return turns, chats
    if w.kind == "bursty":
        # Every tenant gets bursts in turn order shuffled; requests of a burst arrive at once.
        num_bursts = -(-w.num_requests // w.burst)
        order = rng.permutation(np.resize(np.arange(w.tenants), num_bursts))
        i = 0
        for tenant in order.tolist():
            t += float(rng.exponential(w.burst / rate))
            for _ in range(w.burst):
                turns.append(Turn(t, f"r{i}", systems[tenant] + question(), out_len(),
                                  tenant=tenant))
                i += 1
        return turns[: w.num_requests], chats
    tenants = rng.choice(w.tenants, size=w.num_requests, p=weights)
    if w.zipf_s == 0:  # uniform: every tenant the same number of times, in random order
        tenants = rng.permutation(np.resize(np.arange(w.tenants), w.num_requests))
    for i, tenant in enumerate(tenants.tolist()):
        t += float(rng.exponential(1.0 / rate))
        turns.append(Turn(t, f"r{i}", systems[tenant] + question(), out_len(),
                          tenant=tenant))
    return turns, chats
