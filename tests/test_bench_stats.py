"""`qtool bench`'s statistics on synthetic timings: the engines' order, the paired ratio and its
bootstrap interval, the tie rule, and the summary the CLI prints and writes."""
from __future__ import annotations

import numpy as np
import pytest

from qtool.runtime.bench import format_batch, summarize, time_rounds
from qtool.runtime.bench_stats import (
    Ratio,
    is_tie,
    paired_ratios,
    ratio_interval,
    round_order,
    rounds_to_use,
)


def test_round_order_alternates():
    e = ["native", "ort_int8", "ort_fp32"]
    assert [round_order(e, r) for r in range(4)] == [e, e[::-1], e, e[::-1]]
    assert round_order(("a", "b"), 1) == ["b", "a"]


class _Engine:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def run(self, outputs, feeds):
        self.calls.append(self.name)


def test_time_rounds_runs_the_engines_in_turn_and_alternates_the_order():
    calls = []
    engines = {k: _Engine(k[0].upper() if k != "ort_fp32" else "F", calls) for k in ("native", "ort_int8", "ort_fp32")}
    rounds = time_rounds(engines, None, 2, 3, 0.0)
    # each round: the engines' runs in turn, never one engine's block
    assert "".join(calls) == "NOF" * 3 + "FON" * 3
    assert [r["order"][0] for r in rounds] == ["native", "ort_fp32"]
    assert all(len(v) == 3 and all(t >= 0 for t in v) for r in rounds for v in r["runs"].values())


def test_time_rounds_takes_a_timer():
    seen = []

    def timer(engines, order, feeds, min_runs, min_s, settle_s):
        seen.append(tuple(order))
        return {k: [0.001] * min_runs for k in order}

    rounds = time_rounds({"native": 0, "ort_int8": 1}, None, 3, 2, 0.0, timer=timer)
    assert seen == [("native", "ort_int8"), ("ort_int8", "native"), ("native", "ort_int8")]
    assert rounds[1]["runs"] == {"ort_int8": [0.001] * 2, "native": [0.001] * 2}


def test_interval_holds_the_true_ratio_and_excludes_one():
    rng = np.random.default_rng(1)
    host = rng.uniform(1.0, 2.0, 12)  # the host's state moves both engines of a round alike
    native = 2.0 * host * rng.normal(1.0, 0.02, 12)
    ort = 2.4 * host * rng.normal(1.0, 0.02, 12)  # native 1.2x faster
    r = ratio_interval(ort, native)
    assert r.lo <= 1.2 <= r.hi and r.lo <= r.ratio <= r.hi
    assert r.lo > 1.0 and not r.tie
    assert r.half_width < 0.05
    assert r.rounds == 12 and r.level == 0.95
    assert r.text() == f"{r.ratio:.2f}x, 95 % {r.lo:.2f}-{r.hi:.2f}"


def test_pairing_removes_the_host():
    """Rounds 2x apart (a busy host in half of them) leave the paired ratio exact."""
    native = np.array([1.0, 2.0, 1.0, 2.0, 1.0, 2.0])
    r = ratio_interval(1.5 * native, native)
    assert r.ratio == pytest.approx(1.5) and r.lo == pytest.approx(1.5) and r.hi == pytest.approx(1.5)


def test_interval_is_reproducible():
    rng = np.random.default_rng(2)
    a, b = rng.uniform(1, 2, 10), rng.uniform(1, 2, 10)
    assert ratio_interval(a, b) == ratio_interval(a, b)


def test_tie_when_the_interval_holds_one():
    rng = np.random.default_rng(4)
    native = rng.normal(1.0, 0.05, 10)
    ort = rng.normal(1.0, 0.05, 10)
    r = ratio_interval(ort, native)
    assert r.lo < 1.0 < r.hi and r.tie and r.text().startswith("tie, ")
    assert is_tie(0.97, 1.02) and is_tie(1.0, 1.1) and is_tie(0.9, 1.0)
    assert not is_tie(1.01, 1.2) and not is_tie(0.8, 0.99)
    slower = ratio_interval(0.8 * native * rng.normal(1.0, 0.01, 10), native)
    assert slower.hi < 1.0 and not slower.tie


def test_more_rounds_narrow_the_interval():
    rng = np.random.default_rng(5)
    ratios = rng.lognormal(np.log(1.1), 0.08, 80)
    few = ratio_interval(ratios[:8], np.ones(8))
    many = ratio_interval(ratios, np.ones(80))
    assert many.hi - many.lo < few.hi - few.lo


def test_one_round_is_a_point():
    r = ratio_interval([3.0], [2.0])
    assert (r.ratio, r.lo, r.hi) == (1.5, 1.5, 1.5)


def test_bad_timings_are_refused():
    with pytest.raises(ValueError, match="one time per round"):
        paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        paired_ratios([1.0, 0.0], [1.0, 1.0])


def test_summarize_and_format():
    rounds = []
    for r in range(6):
        slow = 2.0 if r % 3 == 0 else 1.0  # a busy host every third round
        rounds.append({"order": round_order(["native", "ort_int8"], r),
                       "runs": {"native": [0.010 * slow, 0.011 * slow, 0.010 * slow],
                                "ort_int8": [0.013 * slow, 0.013 * slow, 0.014 * slow]}})
    s = summarize(rounds, batch=2)
    assert s["native_ms"] == pytest.approx(5.5) and s["ort_int8_ms"] == pytest.approx(7.0)  # medians of all runs
    assert s["ort_fp32_ms"] is None and s["native_vs_ort_fp32"] is None
    assert s["native_vs_ort_int8"] == pytest.approx(1.3)
    i = s["ratios"]["ort_int8"]
    assert i["lo"] == pytest.approx(1.3) and i["hi"] == pytest.approx(1.3) and not i["tie"]
    assert len(s["rounds"]) == 6 and s["rounds"][1]["order"] == ["ort_int8", "native"]
    assert s["rounds"][0]["native_ms"] == pytest.approx([10.0, 11.0, 10.0])  # ms per image, batch 2
    assert s["runs"] == 18
    line = format_batch(2, s)
    assert "native    5.50 ms/image" in line and "(1.30x, 95 % 1.30-1.30)" in line and "[6 rounds, 18 native runs]" in line


def test_ratio_text_names_a_tie():
    assert Ratio(1.01, 0.95, 1.07, 0.95, 10).text() == "tie, 1.01x, 95 % 0.95-1.07"
    assert Ratio(1.2, 1.1, 1.3, 0.95, 10).half_width == pytest.approx(0.1 / 1.2)


def test_busy_rounds_are_left_out():
    assert rounds_to_use([0.0, 0.5, 0.1, None, 1.2, 0.0]) == [0, 2, 3, 5]
    assert rounds_to_use([0.0, 0.9, 0.9, 0.9, 0.0]) == [0, 1, 2, 3, 4]  # busy throughout: all, said so
    assert rounds_to_use([0.0, 0.9, 0.0, 0.9]) == [0, 1, 2, 3]  # 2 quiet rounds: fewer than 3
    assert rounds_to_use([0.3]) == [0] and rounds_to_use([0.0, 0.3]) == [0, 1]


def test_summary_leaves_out_busy_rounds():
    rounds = [{"order": round_order(["native", "ort_int8"], r), "others_cpus": 0.02,
               "runs": {"native": [0.010], "ort_int8": [0.012]}} for r in range(6)]
    rounds[2] = {**rounds[2], "others_cpus": 1.0, "runs": {"native": [0.030], "ort_int8": [0.012]}}
    s = summarize(rounds, batch=1)
    assert s["rounds_used"] == 5 and s["native_ms"] == pytest.approx(10.0)
    assert s["ratios"]["ort_int8"]["ratio"] == pytest.approx(1.2) and s["ratios"]["ort_int8"]["hi"] == pytest.approx(1.2)
    assert [rd["used"] for rd in s["rounds"]] == [True, True, False, True, True, True]
    assert "5 of 6 rounds, 1 left out: other processes busy" in format_batch(1, s)


def test_printed_interval_is_where_another_run_lands():
    """The printed range is for another run's ratio: wider than the median's confidence interval
    (about sqrt(2) for sampling noise alone), and it holds most reruns' medians on synthetic rounds."""
    rng = np.random.default_rng(7)
    draw = lambda: rng.lognormal(np.log(0.95), 0.03, 10)  # noqa: E731  one run's 10 per-round ratios
    runs = [ratio_interval(draw(), np.ones(10)) for _ in range(200)]
    r = runs[0]
    assert r.lo < r.ci_lo <= r.ratio <= r.ci_hi < r.hi
    assert 1.2 < (r.hi - r.lo) / (r.ci_hi - r.ci_lo) < 2.0
    inside = np.mean([a.lo <= b.ratio <= a.hi for a, b in zip(runs[::2], runs[1::2])])
    ci_inside = np.mean([a.ci_lo <= b.ratio <= a.ci_hi for a, b in zip(runs[::2], runs[1::2])])
    assert inside > 0.9 and inside > ci_inside


def test_the_printed_range_holds_the_spread_between_processes():
    """A run's rounds cannot see what changes between processes: `between` widens the printed range
    (in quadrature with the bootstrap's), never the median's confidence interval, and qtool bench uses it."""
    from qtool.runtime.bench import summarize
    from qtool.runtime.bench_stats import BETWEEN_RUNS
    rng = np.random.default_rng(3)
    ratios = rng.lognormal(np.log(0.95), 0.01, 10)
    plain, wide = ratio_interval(ratios, np.ones(10)), ratio_interval(ratios, np.ones(10), between=0.03)
    assert wide.ratio == plain.ratio and (wide.ci_lo, wide.ci_hi) == (plain.ci_lo, plain.ci_hi)
    assert wide.lo < plain.lo and wide.hi > plain.hi
    grow = wide.hi / wide.ratio - 1
    assert grow == pytest.approx(np.hypot(plain.hi / plain.ratio - 1, 0.03))
    # a perfectly steady run still says how far another process's run may land
    point = ratio_interval([1.5, 1.5, 1.5], [1.0, 1.0, 1.0], between=0.03)
    assert point.lo == pytest.approx(1.5 * 0.97) and point.hi == pytest.approx(1.5 * 1.03)
    rounds = [{"order": round_order(["native", "ort_int8"], r), "runs": {"native": [0.010], "ort_int8": [0.012]}}
              for r in range(4)]
    s = summarize(rounds, 1, BETWEEN_RUNS)
    assert s["between_runs"] == BETWEEN_RUNS and s["ratios"]["ort_int8"]["hi"] == pytest.approx(1.2 * (1 + BETWEEN_RUNS))


def _noisy_timer(sd, seed=0):
    """A timer whose ORT runs are 1.2x native's times per-round noise of `sd` (relative)."""
    rng = np.random.default_rng(seed)
    orders = []

    def timer(engines, order, feeds, min_runs, min_s, settle_s):
        orders.append(tuple(order))
        host = rng.uniform(1.0, 1.5)
        return {"native": [0.010 * host] * min_runs, "ort_int8": [0.012 * host * rng.normal(1.0, sd)] * min_runs}
    return timer, orders


def test_rounds_are_added_while_a_range_is_too_wide():
    from qtool.runtime.bench import RoundRules, rounds_until_narrow
    timer, orders = _noisy_timer(0.10)
    r = rounds_until_narrow({"native": 0, "ort_int8": 1}, None, 1, RoundRules(6, 1, 0.0, width=0.10, max_rounds=60),
                            timer=timer)
    assert len(r["rounds"]) > 6 and len(r["rounds"]) % 2 == 0
    assert r["narrow"] and r["widest"] <= 0.10 == r["width_goal"]
    assert r["ratios"]["ort_int8"]["lo"] <= 1.2 <= r["ratios"]["ort_int8"]["hi"]
    # the added rounds keep alternating the order
    assert all(orders[i][0] == ("native" if i % 2 == 0 else "ort_int8") for i in range(len(orders)))


def test_quiet_rounds_need_no_more_and_the_limit_holds():
    from qtool.runtime.bench import RoundRules, format_batch, rounds_until_narrow
    timer, _ = _noisy_timer(0.001)
    assert len(rounds_until_narrow({"native": 0, "ort_int8": 1}, None, 1, RoundRules(6, 1, 0.0), timer=timer)["rounds"]) == 6
    timer, _ = _noisy_timer(0.5)
    r = rounds_until_narrow({"native": 0, "ort_int8": 1}, None, 1, RoundRules(6, 1, 0.0, max_rounds=10), timer=timer)
    assert len(r["rounds"]) == 10 and not r["narrow"]
    assert "at the limit" in format_batch(1, r)
    ticks = iter(range(100))
    r = rounds_until_narrow({"native": 0, "ort_int8": 1}, None, 1, RoundRules(6, 1, 0.0, max_rounds=40, max_s=2.0),
                            timer=_noisy_timer(0.5)[0], clock=lambda: float(next(ticks)))
    assert len(r["rounds"]) == 8  # (two rounds added, then the clock says 2 s)
