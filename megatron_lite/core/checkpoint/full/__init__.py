"""Whole models as full global tensors in one process: gathered from (and loaded into) any layout for the
notebook hand-back and carrying a model over (``state``), and one checkpoint read whole for
``from_pretrained`` and the converters (``reader``)."""
