"""benchmarks/bench_flops.py counts a cell's forward FLOPs as the model and the engine run them.

The per-row costs are measured on one row of one length; these tests check them against
FlopCounterMode on what actually runs: a full forward of several rows (every position's logits,
or a few), and the engine's ``Runner.from_layer`` from a middle layer (its rows above the start
layer, with the last block's MLP truncated where the runner truncates it). And the replay of the
greedy joint walk gives the head sets the walk measured, a turned-down head included.
"""

import dataclasses

import pytest
import torch
from bench_helpers import load_benchmark
from interventions_helpers import model as helper_model
from torch.utils.flop_counter import FlopCounterMode

from gna_lens.heads import Subject
from gna_lens.interventions.runner import Runner


def _bench():
    return load_benchmark("bench_flops.py")


def _flops(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def bridge():
    return helper_model("llama")  # a tiny Llama TransformerBridge: 2 blocks


@pytest.mark.parametrize("keep", [12, 2])
def test_row_costs_add_up_to_a_full_forward_of_several_rows(bridge, keep):
    bench = _bench()
    costs = bench.measure_row_costs(bridge, [12])[12]
    assert len(costs.blocks) == bridge.cfg.n_layers and costs.unembed > 0
    tokens = torch.randint(5, 20, (3, 12), device="cpu")
    measured = _flops(lambda: bridge(tokens, logits_to_keep=keep))
    assert 3 * costs.cell(0, keep) == measured
    # The unembedding is a real share of the count: dropping it would be caught.
    assert 3 * sum(costs.blocks) != measured


@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("start", [0, 1])
def test_a_cell_counts_what_the_runner_runs_from_its_start_layer(bridge, start, keep):
    bench = _bench()
    costs = bench.measure_row_costs(bridge, [12])[12]
    runner = Runner(Subject.of(bridge), keep=keep)
    resid = torch.randn((3, 12, bridge.cfg.d_model), device="cpu")
    tokens = torch.randint(5, 20, (3, 12), device="cpu")
    with torch.no_grad():
        runner.from_layer(start, resid[:1], tokens[:1], [])  # the runner's one-time checks
    one = _flops(lambda: runner.from_layer(start, resid[:1], tokens[:1], []))
    three = _flops(lambda: runner.from_layer(start, resid, tokens, []))
    tail = bench._tail(runner.log.as_info()["paths"], keep)
    assert tail == (keep == 1)  # the bridge truncates after the last mixer for one position only
    # The bridge runs the blocks below ``start`` on one row whatever the rows: two more rows add
    # exactly two cells.
    assert three - one == 2 * costs.cell(start, keep, tail)
    if keep == 1:
        assert costs.cell(start, keep, True) < costs.cell(start, keep, False)


def test_the_joint_walk_replays_with_a_turned_down_head():
    from gna_lens import score_heads
    from gna_lens.scoring import GnaReport
    from gna_lens.scoring.report import JointSet, RejectedHead
    from gna_lens.stats import Estimate
    from gna_lens.testing import toy_control, toy_gna_model, toy_gna_task

    bench = _bench()
    model = toy_gna_model(generic_head=True)
    report = score_heads(
        model, toy_gna_task(model, n_samples=8), control=toy_control(model), max_control=1.0,
        n_examples=0, progress=False,
    )  # fmt: skip
    c = report.top(len(report.heads), joint=False)
    assert len(c) == 5
    # As if c[1] had been turned down: then c[2], c[3], c[4] are tried in one sweep, c[2] joins,
    # and the walk goes on one candidate per sweep.
    est = Estimate(0.0, 0.0, 0.0, 8, "bootstrap")
    joint = JointSet(
        heads=(c[0], c[2], c[3], c[4]), effects=(est,) * 4,
        rejected=(RejectedHead(c[1], 2.0, 1),), bound=1.0, joint_k=16, exhausted=True,
        n_candidates=5,
    )  # fmt: skip
    line = report.method["joint_control"].replace(
        "(4 sweeps of 4 head sets)", "(4 sweeps of 6 head sets)"
    )
    data = dataclasses.replace(report, joint_set=joint).to_dict()
    data["method"] = data["method"] | {"joint_control": line}
    sweeps = bench.replay_joint_walk(GnaReport.from_dict(data))
    assert sweeps == [
        [[c[0], c[1]]],
        [[c[0], c[2]], [c[0], c[3]], [c[0], c[4]]],
        [[c[0], c[2], c[3]]],
        [[c[0], c[2], c[3], c[4]]],
    ]
    with pytest.raises(ValueError, match="sweeps"):  # a method line the replay does not give
        data["method"]["joint_control"] = line.replace("6 head sets", "7 head sets")
        bench.replay_joint_walk(GnaReport.from_dict(data))


def test_sweep_counts_its_clean_run_and_every_cell():
    bench = _bench()
    cost = bench.RowCost(10, (100.0, 200.0, 300.0), 60.0, 7.0)
    sweep = bench.Sweep((10, 10), (2, 0), 1, False)
    # two prompts x (clean run from block 0 + a cell from block 2 + a cell from block 0)
    assert sweep.flops({10: cost}) == 2 * ((600 + 7) + (300 + 7) + (600 + 7))
    tail = bench.Sweep((10,), (2,), 1, True)
    # the last block's MLP at 1 of 10 positions: 60 * 9 / 10 fewer per run
    assert tail.flops({10: cost}) == (600 + 7 - 54) + (300 + 7 - 54)
    # a 4-position shared prefix run once per cell: (2 - 1) prompts x 4 / 10 of its blocks fewer
    shared = bench.Sweep((10, 10), (2, 0), 1, False, prefix=((10, 4),))
    assert shared.flops({10: cost}) == sweep.flops({10: cost}) - 0.4 * (300 + 600)
