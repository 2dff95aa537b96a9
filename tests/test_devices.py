"""Every public function on the model's device: the CPU always, CUDA where there is one.

Each test runs on a ``device`` parameter. On the CPU it runs under
:class:`device_guard.FactoryGuard`: a tensor factory called from gna_lens without ``device=``
raises, so the class of bug that only a GPU would show (a buffer made on the CPU and filled with
CUDA values) fails here too. The ``cuda`` parameter carries the ``cuda`` marker and is skipped,
and reported as skipped, on a machine without CUDA; where CUDA exists it also compares with the
CPU: the same top heads, effects within 1e-3 (``pytest -m cuda`` runs only these).
"""

import contextlib
import json

import pytest
import torch
from device_guard import FactoryGuard
from interventions_helpers import _TMP, other_key, tok
from interventions_helpers import model as helper_model
from interventions_helpers import task as make_task

import gna_lens.interventions as I
from gna_lens.device import DevicePolicy
from gna_lens.models import load_model
from gna_lens.scoring import find_gna_pairs, pattern_scores, retrieval_vs_knowledge, score_heads
from gna_lens.tasks import TextControl
from gna_lens.testing import tiny_hooked_ssm, toy_control, toy_gna_model, toy_gna_task

NO_CUDA = "no CUDA device on this machine: the cuda suite runs where torch sees one"
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)],
    ),
]
TOL = 1e-3  # CPU vs CUDA: float32 kernels differ in summation order (and TF32 where allowed)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def guarded(device):
    """The device rule enforced at run time on the CPU (a GPU enforces it by itself)."""
    if device != "cpu":
        yield None
        return
    with FactoryGuard() as guard:
        yield guard


def on(arch: str, device: str):
    """A fresh tiny model over the test tokenizer on ``device``: a HookedSSM built and moved, or
    the Llama checkpoint loaded there through load_model (the path a user's model takes)."""
    if arch != "llama":
        return tiny_hooked_ssm(arch, vocab_size=len(tok())).to(device)
    helper_model("llama")  # writes the checkpoint
    return load_model(_TMP / "llama", device=device)


def check_same(device: str, got: torch.Tensor, fn, tol: float = TOL) -> None:
    """On CUDA: ``got`` (a host tensor) equals ``fn("cpu")`` within ``tol``."""
    assert got.device.type == "cpu", f"results must come back on the host, got {got.device}"
    if device == "cuda":
        ref = fn("cpu")
        assert torch.allclose(got, ref, atol=tol, rtol=0, equal_nan=True), (got - ref).abs().max()


# ----------------------------------------------------------------------------- the model
@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "bamba"])
def test_forward_cache_step_generate(device, guarded, arch):
    m = tiny_hooked_ssm(arch).to(device)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]], device=device)
    with torch.no_grad():
        logits, cache = m.run_with_cache(tokens)
        _, prefix = m.prefix_state(tokens)
        again = m.step(prefix)
    assert logits.device.type == device and all(
        v.device.type == device for v in cache.cache_dict.values()
    )
    assert torch.allclose(again, logits[:, -1], atol=1e-5)
    pattern = next(v for k, v in cache.cache_dict.items() if k.endswith("hook_pattern"))
    assert pattern.device.type == device
    out = m.generate(tokens, max_new_tokens=3)
    assert out.shape == (1, 9) and out.device.type == device
    if device == "cuda":
        ref = tiny_hooked_ssm(arch)
        with torch.no_grad():
            want = ref(tokens.cpu())
        assert torch.allclose(logits.cpu(), want, atol=TOL)


# ----------------------------------------------------------------------------- rankings
@pytest.mark.parametrize("strategy", ["auto", "exact", "coarse_to_fine", "attribution"])
def test_score_heads_every_strategy(device, guarded, strategy):
    def run(dev):
        m = toy_gna_model().to(dev)
        kw = {"top_layers": 2} if strategy == "coarse_to_fine" else {}
        kw |= {"prefilter": 4} if strategy == "attribution" else {}
        return score_heads(
            m, toy_gna_task(m), control=toy_control(m), strategy=strategy, progress=False, **kw
        )

    report = run(device)
    assert set(report.top(2)) == {(0, 0), (1, 0)}  # the hand-built Gather and Aggregate heads
    effects = report.scores["ablation_effect"]
    check_same(device, effects, lambda dev: run(dev).scores["ablation_effect"])
    if device == "cuda":
        assert report.top(4) == run("cpu").top(4)


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_sweeps_heads_layers_controls(device, guarded, arch):
    t = make_task()

    def heads(dev):
        m = on(arch, dev)
        return I.ablation_sweep(m, t, "logit_diff", progress=False).effects

    gen = torch.Generator().manual_seed(0)
    windows = TextControl("windows", torch.randint(4, len(tok()), (6, 12), generator=gen), "random")

    def control(dev):
        m = on(arch, dev)
        return I.control_sweep(m, windows, progress=False).effects

    def layers(dev):
        m = on(arch, dev)
        return I.layer_sweep(m, t, "logit_diff", control=windows, progress=False).effects

    def heads_at(dev):  # explicit positions: the column masks inside the sweep's hooks
        m = on(arch, dev)
        return I.ablation_sweep(m, t, "logit_diff", positions=[1, 3], progress=False).effects

    for fn in (heads, heads_at, control, layers):
        check_same(device, fn(device), fn)


def test_remove_layers_ablate_heads_and_masks(device, guarded):
    m = on("bamba", device)
    t = make_task()
    tokens = torch.tensor([t[0].input_ids], device=device)
    with torch.no_grad():
        clean = m(tokens)
        with I.remove_layers(m, [0]):
            removed = m(tokens)
        with I.ablate_heads(m, [(0, 0), (1, 1)]):
            ablated = m(tokens)
        # explicit positions: the hooks build their column masks on the model's device
        with I.ablate_heads(m, [(0, 0), (1, 1)], positions=[1, 3]):
            at_positions = m(tokens)
        with I.ablate_heads(m, [(0, 0)], mode="mean", positions="last", reference=t):
            mean_last = m(tokens)
        with I.ablate_layers(m, [1], positions=[2]):
            layer_at = m(tokens)
        masks = {(1, 0): I.aggregate_mask(t[0])}
        with I.mask_patterns(m, masks):
            masked = m(tokens)
    for other in (removed, ablated, at_positions, mean_last, layer_at, masked):
        assert other.device.type == device and not torch.allclose(other, clean)
    with torch.no_grad():
        assert torch.equal(m(tokens), clean)  # nothing left behind


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_patching_and_attribution(device, guarded, arch):
    t = make_task()
    corrupted = other_key(t)

    def patch(dev):
        m = on(arch, dev)
        return I.patch_heads(m, t, corrupted, progress=False).mean()

    def attribute(dev):
        m = on(arch, dev)
        return I.attribute_heads(m, t, corrupted=corrupted).effects

    for fn in (patch, attribute):
        check_same(device, fn(device), fn)


def test_pattern_scores_pairs_and_knowledge(device, guarded):
    m = toy_gna_model().to(device)
    t = toy_gna_task(m)
    scores = pattern_scores(m, t, progress=False)
    assert scores.gather_share.device.type == "cpu"
    pairs = find_gna_pairs(m, t, control=toy_control(m), progress=False)
    assert (pairs[0].gather, pairs[0].aggregate, pairs[0].confirmed) == ((0, 0), (1, 0), True)
    table = retrieval_vs_knowledge(
        m, [(1, 0)], {"kv": t}, control=toy_control(m), random_draws=0, progress=False
    )
    assert table.to_dataframe().shape[0] > 0
    check_same(
        device,
        scores.aggregate_score,
        lambda dev: pattern_scores(toy_gna_model(), t, progress=False).aggregate_score,
    )


# ----------------------------------------------------------------------------- hybrids
def test_build_hybrid_distill_swap(device, guarded):
    from gna_lens.hybrid import build_hybrid, distill, swap_heads

    teacher = on("llama", device)
    student = build_hybrid(teacher, [(0, 0), (1, 1)], d_state=8)
    assert DevicePolicy.of(student).device.type == device
    texts = [" ".join(["apple river stone cloud lamp tree"] * 4)] * 64
    res = distill(student, teacher, texts, budget=600, batch_size=4, progress=False)
    assert res.totals["stage2"]["tokens"] > 0
    base = tiny_hooked_ssm("mamba2").to(device)
    swapped = swap_heads(base, [(0, 0)], train_data=texts, budget=300, progress=False)
    with torch.no_grad():
        assert swapped(torch.tensor([[5, 6, 7]], device=device)).device.type == device


def test_hybrid_cli_on_the_device(device, guarded, tmp_path):
    from gna_lens.cli import main
    from gna_lens.tasks import load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer
    from gna_lens.testing import tiny_checkpoint

    t = word_tokenizer(
        [
            "Below is a list of key-value pairs. What is the value for key ? :",
            "Memorize the following dictionary: The value of the key ' is",
            " ".join(load_words()[:60]),
        ],
        bos=True,
    )
    teacher = tiny_checkpoint("llama", tmp_path / "teacher", vocab_size=len(t))
    t.save_pretrained(teacher)
    out = tmp_path / "out"
    args = ["hybrid", str(teacher), "--keep", "0,2", "--budget", "300", "--out", str(out)]
    args += ["--n-eval", "12", "--n-rank", "6", "--kv-pairs", "2", "--n-knowledge", "0"]
    args += ["--batch-size", "4", "--quiet", "--device", device]
    assert main(args) == 0
    method = json.loads((out / "table.json").read_text())["method"]
    assert method["device"].startswith(device)


# ----------------------------------------------------------------------------- lm-eval and Ray
def test_lm_eval_backend(device, guarded):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional extra gna-lens[lmeval]")
    from lm_eval.api.instance import Instance

    import gna_lens.lm_eval as gl

    helper_model("llama")
    lm = gl.GnaLM(pretrained=str(_TMP / "llama"), batch_size=2, device=device)
    assert DevicePolicy.of(lm.model).device.type == device
    req = Instance("loglikelihood", {}, ("apple river", " stone"), 0)
    ((ll, _),) = lm.loglikelihood([req])
    assert isinstance(ll, float) and ll < 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_ray_one_gpu_per_worker():
    pytest.importorskip("ray", reason="ray is the optional extra gna-lens[ray]")
    from gna_lens.distributed import RayExecutor

    t = make_task()
    m = tiny_hooked_ssm("mamba2").to("cuda")
    with contextlib.closing(RayExecutor(workers=1, gpus_per_worker=1)) as ex:
        sharded = I.ablation_sweep(m, t, "logit_diff", progress=False, executor=ex)
    alone = I.ablation_sweep(m, t, "logit_diff", progress=False)
    assert torch.allclose(sharded.effects, alone.effects, atol=TOL)


# ----------------------------------------------------------------------------- exact on a GPU
def test_auto_strategy_exact_on_a_gpu_when_the_estimate_fits(monkeypatch):
    """Above EXACT_ALL_MAX heads: coarse to fine on the CPU; on a GPU (the seam says CUDA),
    every head exact when the estimate fits the budget, coarse to fine when it does not; the
    report says which and why."""
    import gna_lens.sweep_policy as R

    m = toy_gna_model()
    t = toy_gna_task(m, n_samples=8)
    monkeypatch.setattr(R, "EXACT_ALL_MAX", 2)  # the toy's 4 heads count as a large model
    strategy, why = R.choose_strategy(m, t)
    assert strategy == "coarse_to_fine" and "on cpu" in why
    est, basis = R._exact_seconds(m, t, R.head_view(m))  # the real estimate, timed here
    assert est > 0 and "per row" in basis
    monkeypatch.setattr(R, "_estimate_applies", lambda policy: True)
    monkeypatch.setattr(R, "_exact_seconds", lambda *a: (50.0, "basis"))
    assert R.choose_strategy(m, t, exact_budget_s=120)[0] == "exact"
    strategy, why = R.choose_strategy(m, t, exact_budget_s=10)
    assert strategy == "coarse_to_fine" and "over exact_budget_s=10" in why
    report = score_heads(m, t, control=None, exact_budget_s=120, progress=False)
    assert report.method["strategy"] == "exact" and report.n_unmeasured == 0
    assert "estimated at 50 s" in report.method["strategy_choice"]
