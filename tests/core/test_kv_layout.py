"""The KV memory arithmetic and `specpage kv-plan`."""

import json

import pytest

from specpage.cli import main
from specpage.core import kv_layout
from specpage.core.kv_layout import KvShape

LENGTHS = "37,91,128,201,511"


def test_paging_and_reservation_figures():
    lengths = [37, 91, 128, 201, 511]
    assert kv_layout.reservation(lengths, 512).allocated == 2560
    p16, p32 = kv_layout.paging(lengths, 16), kv_layout.paging(lengths, 32)
    assert (p16.valid, p16.allocated, p16.tail_waste) == (968, 992, 24)
    assert (p32.allocated, p32.tail_waste, p32.block_table_bytes) == (1024, 56, 128)
    assert round(p16.utilization * 100, 2) == 97.58


def test_kv_plan_prints_the_reference_figures(capsys):
    argv = ["kv-plan", "--lengths", LENGTHS, "--block-sizes", "16,32", "--reserve", "512"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "valid positions: 968" in out
    assert "reserve 512: allocated 2560, waste 1592, utilization 37.81%" in out
    assert "paged, block 16: allocated 992, tail waste 24, utilization 97.58%" in out
    assert "paged, block 32: allocated 1024, tail waste 56, utilization 94.53%" in out


def test_kv_plan_json_with_model_configs(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    # SmolLM2-135M's shape: 30 layers, 9 heads of 64, 3 KV heads
    (target / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576, "torch_dtype": "bfloat16",
    }))
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 256, "head_dim": 64,
    }))
    argv = ["kv-plan", "--lengths", LENGTHS, "--block-sizes", "16", "--target", str(target),
            "--draft", str(draft), "--dtype", "fp32", "--budget", "1GiB", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token"] == {"target": 46080, "draft": 4096, "sum": 50176}
    assert plan["blocks_in_budget"] == {"16": 2 ** 30 // (16 * 50176)}
    assert plan["paging"][0]["allocated"] == 992


def test_shape_from_a_transformers_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3
    )
    config.save_pretrained(tmp_path)
    shape = KvShape.from_hf_config(tmp_path, "bf16")
    assert shape == KvShape(layers=3, kv_heads=2, head_dim=16, dtype_bytes=2)
    assert shape.bytes_per_token == 2 * 3 * 2 * 16 * 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lengths", "0,5"], "sequence lengths must be >= 1"),
        (["--lengths", "600", "--reserve", "512"], "exceeds the reservation"),
        (["--lengths", "5", "--budget", "1GiB"], "--budget needs a model"),
        (["--lengths", "5", "--layers", "2"], "go together"),
        (["--lengths", "5", "--layers", "2", "--kv-heads", "1", "--head-dim", "8",
          "--dtype", "fp4"], "unknown dtype 'fp4'"),
        (["--lengths", "5", "--layers", "2", "--kv-heads", "1", "--head-dim", "8",
          "--window", "4"], "--window and --windowed-layers go together"),
        (["--lengths", "5", "--layers", "2", "--kv-heads", "1", "--head-dim", "8",
          "--window", "4", "--windowed-layers", "3"], "windowed layers (3) must be 0 .. "),
    ],
)
def test_kv_plan_bad_input_names_the_problem(argv, message, capsys):
    assert main(["kv-plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_parse_bytes():
    assert kv_layout.parse_bytes("8GiB") == 8 * 2**30
    assert kv_layout.parse_bytes("512MB") == 512 * 10**6
    assert kv_layout.parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="byte count"):
        kv_layout.parse_bytes("lots")


def test_windowed_blocks_are_those_the_window_falls_in():
    # positions 0..99, window 20: positions 80..99, in blocks 5 and 6 of 16
    assert kv_layout.windowed_blocks(100, 16, 20) == 2
    assert kv_layout.windowed_blocks(96, 16, 32) == 2  # 64..95: aligned, two blocks
    assert kv_layout.windowed_blocks(97, 16, 32) == 3  # 65..96 straddles three
    assert kv_layout.windowed_blocks(10, 16, 512) == 1  # shorter than the window
    assert kv_layout.windowed_blocks(100, 16, 0) == 7  # no window: every block


def test_windowed_tables_price_what_a_table_of_their_own_would_hold():
    # Gemma 3 270M's shape: 18 layers, 15 sliding over 512, 1 KV head of 256
    shape = KvShape(18, 1, 256, 2, windowed_layers=15, window=512)
    t = kv_layout.windowed_tables([4096] * 32, 16, shape)
    per_block = 16 * shape.bytes_per_layer_token
    assert t.one_table_bytes == 18 * 32 * 256 * per_block == 32 * 4096 * shape.bytes_per_token
    assert t.windowed_table_bytes == (3 * 32 * 256 + 15 * 32 * 32) * per_block
    assert round(t.saving, 4) == round(1 - (3 + 15 / 8) / 18, 4)


def test_kv_plan_reads_the_windows_of_a_gemma3_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=12,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=128,
        architectures=["Gemma3ForCausalLM"]).save_pretrained(tmp_path)
    argv = ["kv-plan", "--lengths", "1000,64", "--target", str(tmp_path), "--dtype", "bf16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # 10 of the 12 sliding; 1000 positions: 9 blocks of 16 in reach of 128, 63 in all
    assert "target, block 16: 10 of 12 layers slide over 128 positions" in out
    per_block = 16 * 2 * 32 * 2
    one, own = 12 * (63 + 4) * per_block, (2 * (63 + 4) + 10 * (9 + 4)) * per_block
    assert f"one block table {one} B, with a table of their own {own} B" in out
    argv = ["kv-plan", "--lengths", "1000", "--layers", "12", "--kv-heads", "1",
            "--head-dim", "32", "--window", "128", "--windowed-layers", "10", "--dtype", "bf16",
            "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["windowed_tables"]["target"][0]["windowed_table_bytes"] == (
        (2 * 63 + 10 * 9) * per_block)


def test_a_model_without_windows_has_no_windowed_tables(tmp_path, capsys):
    argv = ["kv-plan", "--lengths", "1000", "--layers", "12", "--kv-heads", "1",
            "--head-dim", "32", "--json"]
    assert main(argv) == 0
    assert "windowed_tables" not in json.loads(capsys.readouterr().out)
