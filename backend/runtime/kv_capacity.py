"""How many KV blocks to allocate (pure Python, no torch: the caller measures device memory)."""
from __future__ import annotations


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V for one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def read_mem_available(meminfo_path: str = "/proc/meminfo") -> int:
    """``MemAvailable`` in bytes (what the kernel can hand out without swapping)."""
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as exc:
        raise ValueError(f"kv cache: cannot read {meminfo_path} ({exc}); "
                         "set engine.max_kv_tokens explicitly") from exc
    raise ValueError(f"kv cache: no MemAvailable line in {meminfo_path}; "
                     "set engine.max_kv_tokens explicitly")


def kv_capacity_blocks(block_size: int, bytes_per_token: int, *, max_kv_tokens: int | None = None,
                       free_device_bytes: int | None = None, free_mem_fraction: float = 0.9,
                       cpu_ram_fraction: float = 0.1, max_useful_tokens: int | None = None,
                       min_tokens: int = 0, meminfo_path: str = "/proc/meminfo") -> int:
    """How many KV blocks to allocate.

    - ``max_kv_tokens`` given: exactly enough blocks for that many tokens.
    - GPU (``free_device_bytes`` given, measured by the caller after loading the weights):
      ``free_mem_fraction`` of it; every spare block serves the prefix cache.
    - CPU: ``cpu_ram_fraction`` of ``MemAvailable``, capped at ``max_useful_tokens`` (normally
      max_batch_size * max_seq_len): RAM is shared with everything else on the host, and KV beyond what
      the running batch can fill only feeds the prefix cache.
    Raises ``ValueError`` when the result cannot hold ``min_tokens`` (one max_seq_len sequence).
    """
    if bytes_per_token <= 0:
        raise ValueError(f"kv cache: bytes_per_token {bytes_per_token}; allowed: > 0")
    bytes_per_block = bytes_per_token * block_size
    if max_kv_tokens is not None:
        if not isinstance(max_kv_tokens, int) or max_kv_tokens < 1:
            raise ValueError(f"engine.max_kv_tokens: {max_kv_tokens!r}; allowed: null or an integer >= 1")
        blocks = -(-max_kv_tokens // block_size)
        source = f"engine.max_kv_tokens={max_kv_tokens}"
    elif free_device_bytes is not None:
        if not 0.0 < free_mem_fraction <= 1.0:
            raise ValueError(f"engine.kv_cache_free_mem_fraction: {free_mem_fraction}; allowed: (0, 1]")
        blocks = int(free_device_bytes * free_mem_fraction) // bytes_per_block
        source = (f"{free_mem_fraction} of {free_device_bytes / 2**30:.2f} GiB free device memory "
                  "(raise engine.kv_cache_free_mem_fraction or set engine.max_kv_tokens)")
    else:
        avail = read_mem_available(meminfo_path)
        blocks = int(avail * cpu_ram_fraction) // bytes_per_block
        if max_useful_tokens is not None:
            blocks = min(blocks, -(-max_useful_tokens // block_size))
        source = (f"{cpu_ram_fraction} of {avail / 2**30:.2f} GiB available RAM "
                  "(set engine.max_kv_tokens)")
    if blocks * block_size < max(min_tokens, 1):
        raise ValueError(f"kv cache: {blocks * block_size} tokens from {source} cannot hold one "
                         f"sequence of {min_tokens} tokens; lower engine.max_seq_len or give more memory")
    return blocks


__all__ = ["kv_bytes_per_token", "kv_capacity_blocks", "read_mem_available"]
