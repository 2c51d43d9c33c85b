"""The on-disk format of a checkpoint and what keeps it safe: DCP shards written and read (``sharded``, in the
background: ``async_save``), the non-tensor part as JSON (``meta_json``), DCP and safetensors reads that never
unpickle (``safe_reader``, ``safetensors_io``), per-file checksums (``integrity``), atomic commit, recovery and
the latest record (``commit``), a full disk named (``disk_space``), rank-0 steps shared with every rank
(``rank_zero``), what a checkpoint holds (``inspect``) and where a writer may put its output (``output_dir``).
See docs/checkpoint-format.md."""
