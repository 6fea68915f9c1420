"""The decode attention kernel's launch rules (decode_attention.py launches it): how many
KV splits a sequence gets, how many tokens a tile holds, when the split-K reduction runs in
the same launch, and the fused reduction's arrival counters. Host arithmetic only: cheap,
and nothing here synchronises with the device."""

from __future__ import annotations

import torch

from .counters import arrival_counters
from .host_math import next_power_of_2

# Split-K rule. A plain decode launch has num_seqs * num_kv_heads programs, each walking a
# whole context. A GPU needs enough loads in flight per SM to hide memory latency, and a
# program's tile is BLOCK_N x head_dim: narrow heads need more programs for the same bytes.
#   * the target is _TARGET_PROGRAMS_PER_SM programs per SM for head dim 128, twice that for
#     head dim <= 64;
#   * splits = the target / the programs, rounded (1 when the grid is already about there: no
#     reduction pass, no partial-result traffic), never into pieces shorter than
#     _MIN_TOKENS_PER_SPLIT (below that the partial writes and the second kernel cost more
#     than the parallelism buys), and at most _MAX_SPLITS.
# Measured on an H100 (benchmarks/README, kernels_bench --cases tune, 2026-11-26): Qwen2.5-0.5B
# shape (2 KV heads, dim 64) at batch 64: 1 split 21.8 us, 3 (the old rule, 2 per SM for every
# head dim, rounded up) 14.1, 4 (this rule) 12.8, 6 12.75, 16 16.1 at 1k context, and 104 /
# 58.5 / 54.7 at 4k; 4 KV heads of dim 128 at batch 64: 1 split 53.2 us, 2 54.5 at 1k, 189.8
# and 185.8 at 4k (this rule: 1); at batch 256 one split was fastest for both shapes.
# The context length is bounded from the block-table width (max_blocks_per_seq * block_size),
# a host-side shape, so choosing needs no device-to-host read of seq_lens.
# Example (H100, 132 SMs): batch 1, 4 KV heads, 16k context -> 64 splits of 256 tokens;
# batch 64, 2 KV heads of dim 64 (128 programs, target 528) -> 4 splits; batch 256 -> 1.
_TARGET_PROGRAMS_PER_SM = 2
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 108  # a stand-in for the interpreter, so the rule behaves as on a mid-size GPU


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int, head_dim: int = 128,
) -> int:
    """Number of KV splits per sequence for split-K decode (1 = plain kernel). See above."""
    programs = max(1, num_seqs * num_kv_heads)
    per_sm = _TARGET_PROGRAMS_PER_SM * (2 if head_dim <= 64 else 1)
    wanted = round(per_sm * num_sms / programs)
    longest = max_context_len // _MIN_TOKENS_PER_SPLIT
    if wanted <= 1 or longest < 2:
        return 1
    return max(1, min(wanted, longest, _MAX_SPLITS))


# Tokens per tile. 64 keeps a program's K and V tiles (64 x D_PAD) in registers for D <= 128
# with 4 warps; 32 for wider heads. When the grid is small (at most _WIDE_TILE_PROGRAMS_PER_SM
# programs per SM after splitting) and the cache is 16-bit, 128-token tiles are faster: each
# program has twice the bytes in flight per loop iteration, which is what hides memory latency
# when there are few programs per SM; with many programs the extra registers cost occupancy.
# Measured on an H200 (132 SMs; benchmarks/README "GPU check", kernels_bench --cases tune,
# 2026-11-26, bf16, us, 64-token / 128-token tiles at the split rule's count): 4 KV heads of
# dim 128, batch 64 (256 programs): 45.6 / 38.3 at 1k, 169.3 / 133.1 at 4k; batch 256 (1,024
# programs, above 4 per SM): 130.8 / 140.7 and 508.5 / 537.2, so 64 stays; Qwen2.5-0.5B shape
# (2 KV heads of dim 64) batch 64 with 4 splits (512 programs): 12.25 / 11.34 at 1k, 44.85 /
# 40.33 at 4k; batch 256 (512 programs): 41.9 / 38.1 and 151.1 / 136.2. float32 keeps 64 (its
# tiles are twice the bytes; not swept). Compiled for sm_90 (scripts/compile_kernels.py), a
# 128-token program holds 38 KiB of shared memory at head dim 64 and 72 KiB at 128 (80 pads
# to 128): at most 3 fit an SM (227 KiB) there, so a grid of 3-4 a SM would run in two
# waves; the limit is 3 for heads wider than 64.
# An fp8 cache (kv_dtypes.py) follows the same rule: its tiles are widened to the query's
# dtype after the load, and compiled for sm_90 (bf16 queries, head dim 64) a 128-token
# program takes 128 registers and spills 8-24 bytes a thread (64 tokens: 102-112, none),
# yet it is the faster on a small grid. Measured on an H200 (2026-11-28, the eighth run,
# kernels_bench --cases decode_fp8, e4m3, bf16 queries, us, 64-token / 128-token tiles):
# Qwen2.5-0.5B shape batch 64, 4 splits (512 programs): 15.26 / 15.12 at 1k, 47.53 / 42.68
# at 4k; batch 256 (512 programs): 44.15 / 39.90 and 161.26 / 142.72; 4 KV heads of dim 128
# batch 64 (256 programs): 48.64 / 41.69 and 171.39 / 141.69. Larger grids were not timed
# with fp8 and keep 64 as 16-bit caches do. (Either way the fp8 launch is slower than the
# bf16 one at these shapes, 39.90 against 38.49 us at its best: the widening, not the
# bytes, bounds it.)
# Under a float32 model (float32 dots: a GPU's exactness checks, not its speed) 64 tokens
# took 255 registers and spilled 160 bytes, 32 tokens 168 and none.
_WIDE_TILE_PROGRAMS_PER_SM = 4
_WIDE_TILE_PROGRAMS_PER_SM_D128 = 3


def choose_block_n(num_programs: int, num_sms: int, head_dim: int,
                   dtype: torch.dtype, kv_fp8: bool = False) -> int:
    """Tokens per tile of the decode kernel for a grid of ``num_programs`` (``dtype``: the
    query's; ``kv_fp8``: an fp8 cache). See above."""
    d_pad = next_power_of_2(head_dim)
    if d_pad > 128:
        return 32
    if kv_fp8 and dtype == torch.float32:
        return 32
    per_sm = _WIDE_TILE_PROGRAMS_PER_SM if d_pad <= 64 else _WIDE_TILE_PROGRAMS_PER_SM_D128
    if dtype != torch.float32 and num_programs <= per_sm * num_sms:
        return 128
    return 64


# A context that ends inside a tile (most of them: a serving step's lengths are not
# multiples of 128) reads that last tile in a masked loop of its own after the unmasked
# tiles, so its loads wait alone, with no tile's arithmetic to hide behind. True: one masked
# loop for both (the tail pipelined behind the tile before it, every tile paying the mask).
# The model's attention ran at 0.73 of copy bandwidth (H200, batch 256 at contexts 1,025-
# 1,061, 44 us a layer) against 0.82 in kernels_bench at exactly 1,024 (39 us): a ninth
# 128-token tile for the last few tokens, or more. False until kernels_bench's
# ``decode_tail`` cases have timed both on a GPU.
MASK_EVERY_TILE = False


# Split-K reduction in the attention launch (``_combine_if_last``) instead of a second
# launch: saves the second kernel's launch and ramp (a few us, against 11-45 us kernels at the
# split rule's shapes), costs the last split a serial read of the partials. Measured on an
# H200 (2026-11-27, kernels_bench --cases tune, 32 q / 4 kv heads, d128, batch 64/256, context
# 1k/4k): fused faster at 2-8 splits in 11 of 12 cases (by 0.5-16 us; one tie), slower at 16
# splits in all 4 (by 3-16 us: the last split's serial combine). So: fused up to this many
# splits, the second launch above it (0: never fused).
FUSED_REDUCE_MAX_SPLITS = 8
# Per-device arrival counters of the fused reduction: zero between launches (each launch's
# last splits reset theirs), so one buffer serves every launch on the device's stream —
# launches that overlap on two streams must not share it (the executor uses one stream).
_split_counters: dict[torch.device, torch.Tensor] = {}
_MIN_COUNTERS = 8192  # 256 sequences x 32 KV heads: no growth while CUDA graphs capture


def _counters(device: torch.device, needed: int) -> torch.Tensor:
    return arrival_counters(_split_counters, device, needed, _MIN_COUNTERS)
