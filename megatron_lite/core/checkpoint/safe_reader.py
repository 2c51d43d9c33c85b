"""Old name of :mod:`megatron_lite.core.checkpoint.format.safe_reader` (docs/checkpoint-format.md showed it), kept
importable for now."""

from megatron_lite.core.checkpoint.errors import UnsafeCheckpointError  # noqa: F401
from megatron_lite.core.checkpoint.format.safe_reader import (  # noqa: F401
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_dcp_metadata,
)
