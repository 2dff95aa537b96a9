"""The intervals cover what they say they cover: 95% of them hold the true mean.

The other tests check intervals one example at a time, where an interval at 90% (or 99%) looks
as plausible as one at 95%. Here many independent samples of known mean are drawn and the
share of intervals holding that mean is compared with 95%: 1,500 rows give a standard error of
0.6 points, so an interval computed at 90% (coverage ~89%) or at 99% fails."""

import torch

from gna_lens.stats import bootstrap_interval, draws_interval, two_level_interval, wilson_interval

ROWS, N = 1500, 60
LOW, HIGH = 0.925, 0.97  # percentile bootstrap under-covers slightly at n = 60


def _samples(seed: int, rows: int = ROWS, n: int = N) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # skewed per-unit values (exponential), as per-prompt effects often are; true mean 1.0
    return -torch.log(torch.rand(rows, n, generator=gen, dtype=torch.float64))


def _coverage(intervals, truth: float = 1.0) -> tuple[float, float, float]:
    below = sum(iv.high < truth for iv in intervals) / len(intervals)
    above = sum(iv.low > truth for iv in intervals) / len(intervals)
    return 1 - below - above, below, above


def test_rows_bootstrap_covers_the_mean_95_percent_of_the_time():
    cover, below, above = _coverage(bootstrap_interval(_samples(0), n_boot=1000))
    assert LOW <= cover <= HIGH, (cover, below, above)
    # both tails miss: an interval shifted to one side would fail here
    assert below > 0.005 and above > 0.005, (below, above)


def test_rows_bootstrap_with_missing_units_covers_the_mean_too():
    x = _samples(1)
    x[:, :5] = float("nan")  # the per-row path (NaN units dropped)
    ivs = bootstrap_interval(x[:400], n_boot=1000)
    cover, *_ = _coverage(ivs)
    assert 0.9 <= cover <= 0.985, cover  # 400 rows: standard error 1.1 points


def test_one_dimensional_bootstrap_is_the_rows_one():
    x = _samples(2, rows=3)
    rows = bootstrap_interval(x, n_boot=500)
    for i in range(3):
        one = bootstrap_interval(x[i], n_boot=500)
        assert (one.low, one.high) == (rows[i].low, rows[i].high)


def test_draws_interval_covers_the_mean_as_its_docstring_says():
    # 20 normal draws: the percentile bootstrap covers ~92.5% (the docstring states it)
    gen = torch.Generator().manual_seed(3)
    x = 1.0 + torch.randn(1000, 20, generator=gen, dtype=torch.float64)
    cover, *_ = _coverage([draws_interval(row, n_boot=500) for row in x])
    assert 0.905 <= cover <= 0.96, cover


def test_two_level_interval_covers_a_mean_over_draws_and_prompts():
    # [draws, prompts]: each draw has its own offset (spread over draws) plus prompt noise
    gen = torch.Generator().manual_seed(4)
    covered = 0
    trials = 300
    for _ in range(trials):
        draw_offsets = torch.randn(10, 1, generator=gen, dtype=torch.float64) * 0.5
        prompt_effects = torch.randn(1, 30, generator=gen, dtype=torch.float64)
        values = (
            1.0
            + draw_offsets
            + prompt_effects
            + 0.3 * torch.randn(10, 30, generator=gen, dtype=torch.float64)
        )
        iv = two_level_interval(values, n_boot=400)
        covered += iv.low <= 1.0 <= iv.high
    assert 0.905 <= covered / trials <= 0.985, covered / trials  # 10 draws: ~94% measured


def test_wilson_covers_a_proportion_95_percent_of_the_time():
    gen = torch.Generator().manual_seed(5)
    p, n = 0.3, 80
    hits = (torch.rand(ROWS, n, generator=gen) < p).sum(-1)
    cover = sum((iv := wilson_interval(int(h), n)).low <= p <= iv.high for h in hits) / ROWS
    assert LOW <= cover <= HIGH, cover


def test_paired_permutation_test_rejects_5_percent_of_true_nulls():
    from gna_lens.stats import paired_permutation_test

    x = _samples(6, rows=400, n=30) - 1.0  # mean-zero, skewed: the null holds in every row
    signs = torch.where(
        torch.rand(400, 30, generator=torch.Generator().manual_seed(7)) < 0.5, -1, 1
    )
    x = x * signs  # symmetric about 0, as the sign-flip test assumes
    rejected = sum(paired_permutation_test(row, n_perm=1000) < 0.05 for row in x) / 400
    assert 0.025 <= rejected <= 0.08, rejected


def test_the_bootstrap_of_many_rows_in_blocks_gives_the_numbers_of_one_gather(monkeypatch):
    """Rows are resampled in blocks (memory); every row's interval is the one-gather interval."""
    from gna_lens import stats

    x = torch.randn(40, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    whole = stats.bootstrap_interval(x)
    monkeypatch.setattr(stats, "_BOOT_ELEMENTS", stats.N_BOOTSTRAP * 30 * 3)  # 3 rows a block
    blocks = stats.bootstrap_interval(x)
    assert [(i.low, i.high) for i in whole] == [(i.low, i.high) for i in blocks]


def _normal(seed: int, rows: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 1.0 + torch.randn(rows, n, generator=gen, dtype=torch.float64)


def test_expanded_bootstrap_covers_94_percent_at_the_findings_sizes():
    # The findings page measures held-out prose on 64 windows and KV on 60 prompts: the
    # expanded percentile keeps >= 94% there, on symmetric and on skewed units (a plain
    # percentile bootstrap gives ~93% on the skewed ones, and ~90% at 8 windows).
    for make in (_samples, _normal):
        cover, below, above = _coverage(bootstrap_interval(make(7, 2000, 64), n_boot=1000))
        assert cover >= 0.94, (make.__name__, cover, below, above)
    cover, *_ = _coverage(bootstrap_interval(_normal(8, 2000, 8), n_boot=1000))
    assert cover >= 0.94, cover  # 8 normal units: ~95% (the plain percentile: ~89%)
