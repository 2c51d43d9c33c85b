"""Fill-in-the-middle: PSM / SPM layouts, rates, determinism, document boundaries."""

import numpy as np
import pytest
import torch

from megatron_lite.data.fim import FIMDataset, FIMTokens, fim_sample, permute_document

T = FIMTokens(prefix=901, middle=902, suffix=903, eod=0)


def _rng(seed):
    return np.random.RandomState(seed)


@pytest.mark.parametrize("spm", [False, True])
def test_permuted_document_keeps_length_and_order_of_pieces(spm):
    doc = np.arange(1, 41)
    for seed in range(50):
        out = permute_document(doc, _rng(seed), spm, T)
        assert len(out) == len(doc)
        pre, mid, suf = (int(np.flatnonzero(out == t)[0]) for t in (T.prefix, T.middle, T.suffix))
        if spm:  # <PRE> <SUF> suffix <MID> prefix middle
            assert (pre, suf) == (0, 1)
            suffix, rest = out[2:mid], out[mid + 1 :]
            # prefix + middle is a run of consecutive tokens starting at 1, the suffix continues it
            assert np.array_equal(rest, np.arange(1, len(rest) + 1))
            if len(suffix):
                assert suffix[0] > rest[-1] if len(rest) else True
                assert np.array_equal(suffix, np.arange(suffix[0], suffix[0] + len(suffix)))
        else:  # <PRE> prefix <SUF> suffix <MID> middle
            assert pre == 0 and pre < suf < mid
            prefix, suffix, middle = out[1:suf], out[suf + 1 : mid], out[mid + 1 :]
            assert np.array_equal(prefix, np.arange(1, len(prefix) + 1))
            assert np.array_equal(middle, np.arange(len(prefix) + 1, len(prefix) + len(middle) + 1))
            assert set(suffix.tolist()).isdisjoint(set(prefix.tolist()) | set(middle.tolist()))


def test_rates_zero_and_one():
    sample = np.arange(1, 33)
    assert np.array_equal(fim_sample(sample, _rng(0), 0.0, 0.5, T), sample)
    out = fim_sample(sample, _rng(0), 1.0, 0.0, T)
    assert out[0] == T.prefix and T.suffix in out and T.middle in out


def test_documents_are_permuted_separately_and_eod_stays():
    sample = np.array([5, 6, 7, 8, 9, 0, 11, 12, 13, 14, 15, 16, 0, 21, 22])
    out = fim_sample(sample, _rng(3), 1.0, 0.0, T)
    assert out[5] == 0 and out[12] == 0
    for lo, hi in ((0, 5), (6, 12), (13, 15)):
        piece = out[lo:hi]
        if hi - lo >= 4:
            assert piece[0] == T.prefix  # each long-enough document got its own sentinels
        else:
            assert np.array_equal(piece, sample[lo:hi])


def test_fim_rate_is_respected_over_many_samples():
    base = [{"tokens": torch.arange(1, 65)} for _ in range(2000)]
    ds = FIMDataset(base, T, fim_rate=0.3, fim_spm_rate=0.5, seed=1)
    rate = np.mean([int(ds[i]["tokens"][0] == T.prefix) for i in range(len(ds))])
    assert abs(rate - 0.3) < 0.04


def test_deterministic_per_index_and_seed():
    base = [{"tokens": torch.arange(1, 65)} for _ in range(20)]
    a, b = FIMDataset(base, T, 0.9, 0.5, seed=7), FIMDataset(base, T, 0.9, 0.5, seed=7)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in reversed(range(20)))
    c = FIMDataset(base, T, 0.9, 0.5, seed=8)
    assert any(not torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(20))


def test_bad_rates_and_missing_sentinels():
    with pytest.raises(ValueError, match="fim_rate must be in"):
        FIMDataset([], T, fim_rate=1.5)

    class OneCharTokenizer:
        eod = 0

        def tokenize(self, text):
            return [ord(c) for c in text]

    with pytest.raises(ValueError, match="no single token for '<fim_prefix>'"):
        FIMTokens.from_tokenizer(OneCharTokenizer())
