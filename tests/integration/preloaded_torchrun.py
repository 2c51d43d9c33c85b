"""torchrun whose workers are forked from an agent that has already imported Lightning and megatron-lite::

    python preloaded_torchrun.py [torchrun options] /abs/path/script.py [script args]

is ``torchrun --run-path --start-method fork [torchrun options] script.py [script args]`` (torchrun's own ``main``:
its elastic agent, rendezvous, monitoring and restarts) after ``import lightning, megatron_lite`` in the agent. Each
worker, and each restart's workers, is a process forked from the agent that runs the script as ``__main__``
(``runpy``), with the imports done: a fresh interpreter per rank would spend ~4-5 s of CPU importing Lightning and
~1 s leaving (interpreter finalisation) -- most of a short fault test's CPU (docs/test-budget.md).

For tests whose point is torchrun's launch, world, restarts and what the ranks train. A forked worker leaves through
``os._exit`` (multiprocessing) without interpreter finalisation: what a rank's exit does is tested under plain
torchrun (test_graceful_exit.py, test_watchdog.py, test_trainer_and_cli.py::test_under_torchrun) and by
test_clean_exit.py.
"""

import sys

if __name__ == "__main__":
    import lightning  # noqa: F401  (imported for the forked workers)
    from torch.distributed.run import main

    import megatron_lite  # noqa: F401  (imported for the forked workers)
    import megatron_lite.callbacks  # noqa: F401
    import megatron_lite.data  # noqa: F401

    main(["--run-path", "--start-method", "fork", *sys.argv[1:]])
