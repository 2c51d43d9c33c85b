"""Megatron's ``split`` argument: train/validation/test weights, and their rounding into index boundaries."""

from __future__ import annotations


def parse_split(split: str) -> tuple[float, float, float]:
    """``"98,2"`` or ``"969,30,1"`` (also with ``/``) -> normalised (train, validation, test) fractions."""
    try:
        weights = [float(part) for part in split.replace("/", ",").split(",")]
    except (AttributeError, ValueError) as err:
        raise ValueError(f"split {split!r} is not a list of numbers; use e.g. split='98,2' or '969,30,1'") from err
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"split {split!r} needs 1-3 non-negative weights (train,validation[,test]) with a "
            f"positive sum; use e.g. split='98,2'"
        )
    if weights[0] <= 0:
        raise ValueError(
            f"split {split!r} leaves the train split empty; give train a positive weight, e.g. split='98,2'"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return (weights[0] / total, weights[1] / total, weights[2] / total)


def split_boundaries(fractions: tuple[float, ...], size: int) -> list[int]:
    """Megatron's rounding of split fractions into index boundaries over ``size`` items.

    Split ``i`` is ``[bounds[i], bounds[i + 1])``; the rounding difference goes to the train split, so the
    last boundary is exactly ``size``.
    """
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * size)))
    diff = bounds[-1] - size
    return [bounds[0]] + [b - diff for b in bounds[1:]]
