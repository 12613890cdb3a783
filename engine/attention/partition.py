"""How the decode kernels split a long context across thread blocks (split-K).

Each (sequence, KV head, partition) is one thread block. Long partitions waste less
on merging; short ones keep the GPU busy when there are few sequences. Start at the
kernels' largest partition and halve while the launch would have fewer than two
blocks per SM, down to 128 tokens (or one cache block).
"""

from ...csrc.checks import MAX_PARTITION_SIZE

MIN_PARTITION_SIZE = 128  # shorter partitions cost more in the merge than they gain in parallelism
BLOCKS_PER_SM = 2


def decode_partition_size(num_seqs: int, num_kv_heads: int, max_len: int, block_size: int, num_sms: int) -> int:
    """Tokens per partition: a multiple of ``block_size``, at most MAX_PARTITION_SIZE.
    ``max_len``: the widest block table in tokens (max_blocks * block_size)."""
    size = max(block_size, MAX_PARTITION_SIZE // block_size * block_size)
    floor = max(block_size, MIN_PARTITION_SIZE)
    while size // 2 >= floor and size // 2 % block_size == 0 and \
            num_seqs * num_kv_heads * -(-max_len // size) < BLOCKS_PER_SM * num_sms:
        size //= 2
    return size
