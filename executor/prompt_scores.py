"""What a step returns about the prompts it computed, from their hidden states: prompt
logprobs and embeddings.

Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the
tokens before it, its rank in that distribution and the top-k, from the hidden states of
the step that computed it.

A prefill row at position p predicts the token at p + 1, so a step that computes positions
c .. c + n - 1 of a prompt of L tokens scores prompt tokens c + 1 .. min(c + n, L - 1): the
row of the last prompt token predicts the first output token, which the sampler scores. The
scores leave with the step's result; the router keeps each position once (a recompute scores
again what it already has). Logits are the lm head over those rows only, in slices of
`SLICE_ROWS` (a 4k-token prompt over a 150k vocabulary would otherwise be 2.4 GB of fp32),
log-softmax of the raw logits, as for sampled tokens.

Embeddings (SamplingParams.embed): the final hidden state (after the model's last norm,
as transformers' last ``hidden_states``) of the prompt's last token, from the step that
computes that token, widened to float32; the router pools nothing more (last-token
pooling, as decoder embedding models use) and normalizes. A prefix-cache hit never covers
a prompt's last token, so every embedding request computes it.

Runs only when a request of the step asked for either: nothing is added to a step without
one.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

SLICE_ROWS = 512


def score_prompts(model, hidden: torch.Tensor, request_ids: list[str],
                  num_computed: np.ndarray, num_new: np.ndarray, kept: np.ndarray | None,
                  states: Mapping[str, object]) -> dict | None:
    """StepResult's prompt_* fields for the rows of this step that compute prompt tokens of
    requests asking for prompt logprobs (`states`: request id → SamplingState, only those);
    None when there are none. `kept`: the plan rows in the batch (None: all of them), whose
    new tokens are `hidden`'s rows back to back."""
    rows = np.arange(len(request_ids)) if kept is None else kept
    starts = np.cumsum(num_new[rows]) - num_new[rows]
    hidden_rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    ids, firsts, counts, ks = [], [], [], []
    vocab = None
    for row, start in zip(rows.tolist(), starts.tolist(), strict=True):
        state = states.get(request_ids[row])
        if state is None or state.params.prompt_logprobs is None:
            continue
        prompt = state.prompt_token_ids
        computed, n = int(num_computed[row]), int(num_new[row])
        last = min(computed + n, prompt.shape[0] - 1)  # positions computed .. last - 1
        if last <= computed:
            continue
        count = last - computed
        hidden_rows.append(np.arange(start, start + count))
        targets.append(prompt[computed + 1:last + 1])
        ids.append(request_ids[row])
        firsts.append(computed + 1)
        counts.append(count)
        ks.append(int(state.params.prompt_logprobs))
    if not ids:
        return None
    index = torch.from_numpy(np.concatenate(hidden_rows)).to(hidden.device)
    target = torch.from_numpy(np.concatenate(targets).astype(np.int64)).to(hidden.device)
    owner_k = np.repeat(np.asarray(ks, dtype=np.int64), counts)
    chosen, ranks, top_ids, top_lps = [], [], [], []
    for lo in range(0, index.shape[0], SLICE_ROWS):
        hi = min(lo + SLICE_ROWS, index.shape[0])
        lp = torch.log_softmax(model.compute_logits(hidden[index[lo:hi]]).float(), -1)
        vocab = lp.shape[1]
        picked = lp.gather(1, target[lo:hi].unsqueeze(1))
        chosen.append(picked.squeeze(1).cpu())
        # rank: 1 + how many tokens are strictly more likely (ties share the better rank)
        ranks.append(((lp > picked).sum(1) + 1).cpu())
        k_max = min(int(owner_k[lo:hi].max()), vocab)
        if k_max:
            top = lp.topk(k_max, dim=-1)
            want = np.arange(k_max)[None, :] < np.minimum(owner_k[lo:hi], vocab)[:, None]
            want_t = torch.from_numpy(want).to(lp.device)
            top_ids.append(top.indices[want_t].cpu())
            top_lps.append(top.values[want_t].cpu())
    empty_i, empty_f = torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    return dict(
        prompt_ids=ids,
        prompt_starts=np.asarray(firsts, dtype=np.int32),
        prompt_counts=np.asarray(counts, dtype=np.int32),
        prompt_ks=np.minimum(np.asarray(ks, dtype=np.int32), vocab),
        prompt_logprobs=torch.cat(chosen).numpy().astype(np.float32),
        prompt_ranks=torch.cat(ranks).numpy().astype(np.int32),
        prompt_top_token_ids=torch.cat(top_ids or [empty_i]).numpy().astype(np.int32),
        prompt_top_logprobs=torch.cat(top_lps or [empty_f]).numpy().astype(np.float32),
    )


def prompt_outputs(model, hidden: torch.Tensor, request_ids: list[str],
                   num_computed: np.ndarray, num_new: np.ndarray, kept: np.ndarray | None,
                   states: Mapping[str, object]) -> dict | None:
    """StepResult's prompt_* and embed* fields for this step (``states``: the requests
    asking for prompt logprobs or an embedding); None when it has neither."""
    scores = score_prompts(model, hidden, request_ids, num_computed, num_new, kept, states)
    embedded = embed_prompts(hidden, request_ids, num_computed, num_new, kept, states)
    if embedded is not None:
        scores = {**(scores or {}), **embedded}
    return scores


def embed_prompts(hidden: torch.Tensor, request_ids: list[str], num_computed: np.ndarray,
                  num_new: np.ndarray, kept: np.ndarray | None,
                  states: Mapping[str, object]) -> dict | None:
    """``embed_ids`` / ``embeddings`` for the rows of this step that compute the last token
    of a prompt asking for its embedding; None when there are none."""
    rows = np.arange(len(request_ids)) if kept is None else kept
    ends = np.cumsum(num_new[rows])
    ids, last_rows = [], []
    for row, end in zip(rows.tolist(), ends.tolist(), strict=True):
        state = states.get(request_ids[row])
        if state is None or not state.params.embed:
            continue
        if int(num_computed[row]) + int(num_new[row]) != state.prompt_token_ids.shape[0]:
            continue  # an earlier chunk, or a decode after the prompt
        ids.append(request_ids[row])
        last_rows.append(end - 1)
    if not ids:
        return None
    index = torch.as_tensor(last_rows, dtype=torch.long).to(hidden.device)
    return dict(embed_ids=ids, embeddings=hidden[index].float().cpu().numpy())
