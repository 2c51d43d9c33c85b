"""``python -m megatron_lite`` is the ``megatron-lite`` command."""

from megatron_lite.cli import main

if __name__ == "__main__":
    main()
