"""Paged-attention kernels (Triton) and their pure-torch twins.

KV-cache layout, decided once: an executor holds one tensor
``kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``. For one layer,
``kv_cache[l, 0]`` is the key cache and ``kv_cache[l, 1]`` the value cache, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` and contiguous. A block is therefore one
contiguous run of ``block_size * num_kv_heads * head_dim`` elements per layer and kind, the
head dimension is innermost (coalesced loads of a key row), and copy-on-write or swap of a
block list is a single indexed copy over the first three dimensions for all layers at once.
The CPU swap space has the same layout with ``num_cpu_blocks`` blocks.

The public entry points (``ops``) pick the Triton kernel for CUDA tensors and the torch twin
otherwise (``backend="auto"|"triton"|"torch"``, env override ``PAGEDSERVE_KERNEL_BACKEND``);
the twins live in ``reference``. One file per kernel family, each with its launcher:
``decode_attention`` (plain and split-K decode + LSE reduction, the split rule),
``prefill_attention`` (varlen prefill/extend: chunked prefill, prefix hits), ``cache_ops``
(reshape_and_cache, copy_blocks, the device<->CPU swap helper), ``layer_ops`` (the fused
per-layer elementwise ops: RMSNorm with the residual add, rotary, SiLU-and-multiply),
``sampling_ops`` (the sampler's whole-row top-p threshold, with no host read), ``kv_tiles``
(a tile of keys and values through a block table, both attention kernels'). ``testing``
builds paged inputs for tests and benchmarks/kernels_bench.py.
"""
