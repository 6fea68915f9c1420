"""Host block copies (kernels/block_copy.py) against the twin's indexed copy: JSON lines.

What the CPU executor does with KV blocks outside the forward: swap-in and swap-out
(preemption, the host tier's hits, received blocks), copy-on-write, and the block-major
bytes of `CacheEngine.export_blocks` / `import_blocks` (prefill/decode handoffs, prefix
pulls). Caches shaped like the built-in model's (30 layers, 3 KV heads, head dim 64, 16
tokens a block, bfloat16: 368,640 bytes a block), one torch thread, warm pages (every
block written once before timing: a first touch of a fresh page costs the same either
way). For n blocks in (1, 16, 64, 512) and ids either consecutive (as the allocator mostly
hands them out) or scattered at random: milliseconds, the best of 7 runs, of

* `twin`: `dst[:, :, dst_ids] = src[:, :, src_ids]` (kernels/reference.py);
* `runs`: `block_copy.copy_blocks_by_runs` (what ops.swap_blocks runs on the CPU now);
* `export_twin` / `export_runs`: the blocks as block-major bytes (index_select + movedim +
  contiguous, the old `export_blocks`; against runs into one buffer);
* `import_twin` / `import_runs`: block-major bytes into the CPU cache.

    .venv/bin/python benchmarks/block_copy_bench.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagedserve.kernels.block_copy import copy_blocks_by_runs  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
DEVICE_BLOCKS, CPU_BLOCKS = 2048, 1024
TAIL = (BLOCK, HEADS, HEAD_DIM)


def best_ms(fn, runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1e3, 3)


def case_figures(device: torch.Tensor, host: torch.Tensor, src: np.ndarray,
                 dst: np.ndarray, block_bytes: int) -> dict:
    """The six timings of one (blocks, ids) case: host blocks `src` <-> device `dst`."""
    n = len(src)
    t_src, t_dst = torch.from_numpy(src), torch.from_numpy(dst)
    data = np.empty(n * block_bytes, dtype=np.uint8)
    major = torch.from_numpy(data).view(device.dtype).view(n, *device.shape[:2],
                                                           *device.shape[3:])
    in_cache_layout = major.movedim(0, 2)

    def twin() -> None:
        device[:, :, t_dst] = host[:, :, t_src]

    def export_twin() -> np.ndarray:
        blocks = device.index_select(2, t_dst).movedim(2, 0).contiguous()
        return blocks.view(-1).view(torch.uint8).numpy()

    def import_twin() -> None:
        host[:, :, t_src] = in_cache_layout

    return {
        "twin": best_ms(twin),
        "runs": best_ms(lambda: copy_blocks_by_runs(host, device, src, dst)),
        "export_twin": best_ms(export_twin),
        "export_runs": best_ms(lambda: copy_blocks_by_runs(device, in_cache_layout, dst,
                                                           np.arange(n))),
        "import_twin": best_ms(import_twin),
        "import_runs": best_ms(lambda: copy_blocks_by_runs(in_cache_layout, host,
                                                           np.arange(n), src)),
    }


def main() -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    device = torch.randn(LAYERS, 2, DEVICE_BLOCKS, *TAIL).to(torch.bfloat16)
    host = torch.randn(LAYERS, 2, CPU_BLOCKS, *TAIL).to(torch.bfloat16)
    block_bytes = device[:, :, 0].numel() * device.element_size()
    for n in (1, 16, 64, 512):
        for ids in ("consecutive", "scattered"):
            if ids == "consecutive":
                src, dst = np.arange(100, 100 + n), np.arange(7, 7 + n)
            else:
                src = rng.permutation(CPU_BLOCKS)[:n]
                dst = rng.permutation(DEVICE_BLOCKS)[:n]
            figures = case_figures(device, host, src, dst, block_bytes)
            print(json.dumps({"bench": "block_copy_bench", "blocks": n, "ids": ids,
                              "mb": round(n * block_bytes / 1e6, 2), "unit": "ms",
                              **figures}), flush=True)


if __name__ == "__main__":
    main()
