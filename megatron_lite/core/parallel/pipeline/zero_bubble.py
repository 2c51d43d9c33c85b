"""The zero-bubble pipeline schedules' action orders (Qi et al., *Zero Bubble Pipeline Parallelism*, 2024; DeepSeek's
DualPipe in its V form): every backward split into "B" (input gradient) and "W" (weight gradient), W's placed where
1F1B idles. Actions are ``(kind, chunk, microbatch)`` as in :mod:`.schedules`, which runs them.

``zbv`` and ``dualpipev`` run two chunks per rank in the V placement
(:func:`~megatron_lite.core.parallel.pipeline_stages.stage_chunks`): chunk 0 of rank ``r`` is virtual stage ``r``,
chunk 1 is ``2P - 1 - r``, so the first and the last stage share rank 0 and the middle of the model turns around on
rank ``P - 1`` without a transfer. The orders are those of ``torch.distributed.pipelining``'s
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (tests compare them), written as data for our executor;
DualPipeV's overlapped forward-and-backward pairs run one after the other here.
"""

from __future__ import annotations

Order = list[tuple[str, int, int]]


def zero_bubble_h1_order(num_microbatches: int, pp_size: int, pp_rank: int) -> Order:
    """ZB-H1 (Qi et al., *Zero Bubble Pipeline Parallelism*, 2024): 1F1B's forwards and input-gradient
    backwards (B), each microbatch's weight-gradient pass (W) ``pp_rank`` backwards after its B.

    Rank ``r`` waits ``r`` fewer warm-up forwards than rank 0 and would idle as long in the cool-down; the W's
    it holds back fill exactly that idle time. With forward, B and W of equal duration the bubble is
    ``(P-1)/(3M+P-1)``, a third of 1F1B's, and no rank holds more than ``P`` microbatches' activations
    (forward done, W not yet), 1F1B's peak on its first stage.
    """
    M, P = num_microbatches, pp_size
    warmup = min(P - pp_rank - 1, M)
    order: Order = [("F", 0, m) for m in range(warmup)]
    weights_done = 0

    def backward(m: int) -> None:
        nonlocal weights_done
        order.append(("B", 0, m))
        if m >= pp_rank:
            order.append(("W", 0, weights_done))
            weights_done += 1

    for i in range(M - warmup):
        order.append(("F", 0, warmup + i))
        backward(i)
    for m in range(M - warmup, M):
        backward(m)
    order += [("W", 0, m) for m in range(weights_done, M)]
    return order


def zero_bubble_v_order(num_microbatches: int, pp_size: int, pp_rank: int) -> Order:
    """ZB-V: two chunks per rank in the V placement; with forward, B and W of equal duration and M >= 2P its bubble
    is near zero, at the activation memory of 1F1B's first stage (2P chunk-microbatches of half the layers)."""
    M, P, r = num_microbatches, pp_size, pp_rank
    padded = max(2 * P - 1, M)  # the steady phase needs 2P - 1 microbatches; the extra ones are dropped below
    order: Order = []
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}

    def act(kind: str, chunk: int, mb: int | None = None) -> None:
        if mb is None:
            mb = count[(kind, chunk)]
            count[(kind, chunk)] += 1
        order.append((kind, chunk, mb))

    for _ in range(2 * (P - r) - 1):
        act("F", 0)
    for _ in range(r):
        act("F", 1)
        act("F", 0)
    for _ in range(P - r):
        act("F", 1)
        mb = count[("B", 1)]
        act("B", 1)
        act("W", 1, mb)
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < padded:
        if count[("F", 0)] < padded:
            act("F", 0)
        mb = count[("B", 0)]
        act("B", 0)
        act("W", 0, mb)
        act("F", 1)
        mb = count[("B", 1)]
        act("B", 1)
        act("W", 1, mb)
    weights = {0: count[("B", 0)], 1: count[("B", 1)]}
    for _ in range(r):
        act("B", 0)
        act("B", 1)
    for _ in range(P - r):
        act("B", 0)
        act("W", 0, weights[0])
        weights[0] += 1
    for chunk in (1, 0):
        while weights[chunk] < count[("B", chunk)]:
            act("W", chunk, weights[chunk])
            weights[chunk] += 1
    return [action for action in order if action[2] < M]


def dual_pipe_v_order(num_microbatches: int, pp_size: int, pp_rank: int) -> Order:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V, two chunks per rank): forwards of both chunks, then pairs of
    one chunk's forward with the other's backward (overlapped on GPUs in DeepSeek's implementation, one after the
    other here), the second half of the backwards split so that their W's fill the cool-down. Needs M >= 2P."""
    M, P, r = num_microbatches, pp_size, pp_rank
    if M < 2 * P:
        raise ValueError(
            f"pipeline_schedule='dualpipev' needs at least 2 x pipeline_model_parallel_size ({2 * P}) microbatches "
            f"per step, got {M}; raise global_batch_size or use 'zbv'"
        )
    order: Order = []
    forwards, backwards = [0, 0], [0, 0]
    weights_pending: list[tuple[int, int]] = []

    def forward(chunk: int) -> None:
        order.append(("F", chunk, forwards[chunk]))
        forwards[chunk] += 1

    def backward(chunk: int, split: bool = False) -> None:
        """The whole backward (B then its W at once), or with ``split`` its B alone, the W queued."""
        mb = backwards[chunk]
        backwards[chunk] += 1
        order.append(("B", chunk, mb))
        if split:
            weights_pending.append((chunk, mb))
        else:
            order.append(("W", chunk, mb))

    def pending_weight() -> None:
        if weights_pending:
            chunk, mb = weights_pending.pop(0)
            order.append(("W", chunk, mb))

    for _ in range((P - r - 1) * 2):
        forward(0)
    for _ in range(r + 1):
        forward(0)
        forward(1)
    for _ in range(P - r - 1):
        backward(1, split=True)
        pending_weight()
        forward(1)
    for _ in range(M - 2 * P + r + 1):
        forward(0)  # with the next backward: an overlapped pair in DeepSeek's implementation
        backward(1)
        forward(1)
        backward(0)
    for _ in range(P - r - 1):
        backward(1)
        forward(1)
        backward(0)
    split = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            split = True
        backward(1, split)
        if i == steps // 2 and r % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(P - r - 1):
        pending_weight()
        backward(0, split)
    for _ in range(r + 1):
        pending_weight()
    return order
