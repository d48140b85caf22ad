"""``replystream kv`` reproduces every worked number of the reference article exactly."""

from __future__ import annotations

import dataclasses
import json

import pytest

from replystream.cli import main
from replystream.lab.kvcalc import PRESETS, KVQuery, format_bytes, kv_sizes

ARTICLE = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16"]


def kv_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["kv", *args, "--json"]) == 0
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    return result


def test_article_bytes_per_token_is_128_kib(capsys):
    result = kv_json(capsys, *ARTICLE, "--tokens", "4096")
    assert result["bytes_per_token"] == 131_072
    assert format_bytes(131_072) == "128 KiB"


def test_article_4096_token_sequence_is_512_mib(capsys):
    result = kv_json(capsys, *ARTICLE, "--tokens", "4096")
    assert result["bytes_per_sequence"] == 536_870_912
    assert format_bytes(536_870_912) == "512 MiB"


def test_article_128_sequences_fit_in_64_gib(capsys):
    result = kv_json(capsys, *ARTICLE, "--tokens", "4096", "--memory-gib", "64")
    assert result["sequences_that_fit"] == 128


def test_article_decode_step_25_ms_against_8_ms_for_weights_alone(capsys):
    result = kv_json(
        capsys,
        *ARTICLE,
        "--tokens",
        "4096",
        "--weights-gb",
        "16",
        "--bandwidth-tbs",
        "2",
        "--batch",
        "64",
    )
    step = result["decode_step"]
    assert isinstance(step, dict)
    assert step["batch_cache_bytes"] == 32 * 2**30  # 32 GiB, about 34.4 GB
    assert round(step["batch_cache_bytes"] / 1e9, 1) == 34.4
    assert round(step["step_floor_ms"]) == 25
    assert step["weights_only_floor_ms"] == pytest.approx(8.0)


def test_article_practice_2048_tokens_is_256_mib_and_128_fit_in_32_gib(capsys):
    result = kv_json(capsys, *ARTICLE, "--tokens", "2048", "--memory-gib", "32")
    assert result["bytes_per_sequence"] == 268_435_456
    assert format_bytes(268_435_456) == "256 MiB"
    assert result["sequences_that_fit"] == 128


def test_human_report_prints_the_article_numbers(capsys):
    args = [*ARTICLE, "--tokens", "4096", "--memory-gib", "64"]
    args += ["--weights-gb", "16", "--bandwidth-tbs", "2", "--batch", "64"]
    assert main(["kv", *args]) == 0
    out = capsys.readouterr().out
    for text in ("131,072 B = 128 KiB", "536,870,912 B = 512 MiB", "128 full-length", "25.18 ms"):
        assert text in out
    assert "weights alone: 8.00 ms" in out


def test_sliding_window_caps_the_cache_per_sequence():
    full = kv_sizes(KVQuery(layers=32, kv_heads=8, head_dim=128, tokens=32768))
    windowed = kv_sizes(
        KVQuery(layers=32, kv_heads=8, head_dim=128, tokens=32768, sliding_window=4096)
    )
    assert windowed["bytes_per_sequence"] == full["bytes_per_sequence"] // 8


@pytest.mark.parametrize(
    ("dtype", "per_token"), [("fp32", 262_144), ("fp8", 65_536), ("int4", 32_768)]
)
def test_bytes_per_element_follows_the_cache_dtype(dtype, per_token):
    result = kv_sizes(KVQuery(layers=32, kv_heads=8, head_dim=128, tokens=1, dtype=dtype))
    assert result["bytes_per_token"] == per_token


def test_presets_carry_the_published_shapes(capsys):
    assert (PRESETS["llama-3-8b"].layers, PRESETS["llama-3-8b"].kv_heads) == (32, 8)
    assert (PRESETS["llama-3-70b"].layers, PRESETS["llama-3-70b"].kv_heads) == (80, 8)
    assert PRESETS["mistral-7b-v0.1"].sliding_window == 4096
    assert (PRESETS["qwen2-7b"].layers, PRESETS["qwen2-7b"].kv_heads) == (28, 4)
    result = kv_json(capsys, "--model", "llama-3-8b", "--tokens", "4096")
    assert result["bytes_per_sequence"] == 536_870_912  # the article's shape is Llama-3-8B's


def test_missing_shape_is_a_usage_error(capsys):
    assert main(["kv", "--layers", "32", "--tokens", "10"]) == 2
    assert "--kv-heads" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["memory_gib", "weights_gb", "bandwidth_tbs"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0, 1e300])
def test_an_amount_the_arithmetic_cannot_hold_is_refused_by_the_query(field, value):
    query = KVQuery(layers=32, kv_heads=8, head_dim=128, tokens=4096)
    with pytest.raises(ValueError, match=f"{field} must be from 1e-09 to 1e"):
        dataclasses.replace(query, **{field: value})


def test_the_largest_amounts_give_finite_numbers(capsys):
    args = ["--tokens", "4096", "--memory-gib", "1e12", "--weights-gb", "1e12"]
    slowest = kv_json(capsys, *ARTICLE, *args, "--bandwidth-tbs", "1e-9")
    fastest = kv_json(capsys, *ARTICLE, *args, "--bandwidth-tbs", "1e12")
    for result in (slowest, fastest):
        step = result["decode_step"]
        assert isinstance(step, dict)
        assert 0 < step["step_floor_ms"] < float("inf")
        assert 0 < step["tokens_per_s_ceiling"] < float("inf")
    assert slowest["sequences_that_fit"] == 2_000_000_000_000  # 1e12 GiB / 512 MiB


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layers", 0),
        ("kv_heads", 10**6 + 1),
        pytest.param("tokens", 10**400, id="tokens-10**400"),
        ("sliding_window", 0),
    ],
)
def test_a_count_out_of_range_is_refused_by_the_query(field, value):
    query = KVQuery(layers=32, kv_heads=8, head_dim=128, tokens=4096)
    with pytest.raises(ValueError, match=f"{field} must be from 1 to"):
        dataclasses.replace(query, **{field: value})


def test_the_largest_counts_give_finite_numbers(capsys):
    shape = ["--layers", "1000000", "--kv-heads", "1000000", "--head-dim", "1000000"]
    sizes = ["--tokens", "1000000000000", "--batch", "1000000000", "--dtype", "fp32"]
    amounts = ["--memory-gib", "1e-9", "--weights-gb", "1e12", "--bandwidth-tbs", "1e-9"]
    result = kv_json(capsys, *shape, *sizes, *amounts)
    step = result["decode_step"]
    assert isinstance(step, dict)
    assert result["bytes_per_sequence"] == 2 * 10**18 * 4 * 10**12
    assert 0 < step["tokens_per_s_ceiling"] and step["step_floor_ms"] < float("inf")


def test_a_preset_with_its_shape_changed_says_so(capsys):
    assert main(["kv", "--model", "llama-3-8b", "--layers", "10"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: llama-3-8b (published shape but layers 10;")
    assert "2 x 10 layers" in out
    assert main(["kv", "--model", "llama-3-8b", "--layers", "10", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["layers"], model["changed"]) == (10, ["layers"])
    # A value equal to the preset's changes nothing.
    assert main(["kv", "--model", "llama-3-8b", "--layers", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["changed"] == []


def test_a_changed_shape_needs_its_own_weights_to_size_a_step(capsys):
    # The preset's 8.03 B parameters are not a 10-layer model's: the step would be wrong.
    assert main(["kv", "--model", "llama-3-8b", "--layers", "10", "--bandwidth-tbs", "3"]) == 2
    assert capsys.readouterr().err == (
        "replystream kv: --layers changes llama-3-8b's shape, so its weights are not the "
        "preset's: give --weights-gb\n"
    )
    # A window changes no weight: the preset's still hold.
    assert main(["kv", "--model", "llama-3-8b", "--window", "100", "--bandwidth-tbs", "3"]) == 0
    assert "sliding window 100" in capsys.readouterr().out


def step_of(result: dict[str, object]) -> dict[str, object]:
    step = result["decode_step"]
    assert isinstance(step, dict)
    return step


def test_a_batch_the_memory_cannot_hold_is_said_beside_its_step(capsys):
    # 40 GiB holds 16 of Llama-3-70B's 2.5 GiB sequences: a step of 64 is no batch it can run.
    args = ["--model", "llama-3-70b", "--memory-gib", "40", "--bandwidth-tbs", "3.35"]
    assert main(["kv", *args, "--batch", "64"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(
        "at most 685 tokens/s, but 64 sequences need 160 GiB of cache: 40 GiB holds 16"
    )
    assert step_of(kv_json(capsys, *args, "--batch", "64"))["batch_fits_memory"] is False
    # A batch the memory holds has no such note.
    assert main(["kv", *args, "--batch", "16"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("at most 291 tokens/s")
    assert step_of(kv_json(capsys, *args, "--batch", "16"))["batch_fits_memory"] is True
    # Without --memory-gib nothing is known about the fit.
    assert "batch_fits_memory" not in step_of(kv_json(capsys, *args[:2], *args[4:]))


def test_the_report_names_the_memory_and_bandwidth_as_given(capsys):
    # A pool of whole blocks in GiB is a binary fraction of many digits (2 MiB: 64 blocks of
    # the tiny model's 16 tokens): six significant digits named another amount than given.
    shape = ["--layers", "4", "--kv-heads", "2", "--head-dim", "32", "--tokens", "100"]
    amounts = ["--memory-gib", "0.001953125", "--weights-gb", "0.5"]
    assert main(["kv", *shape, *amounts, "--bandwidth-tbs", "0.05123415", "--batch", "30"]) == 0
    out = capsys.readouterr().out
    assert "in 0.001953125 GiB:" in out
    assert "/ 0.05123415 TB/s" in out
    assert out.rstrip().endswith("of cache: 0.001953125 GiB holds 20")


@pytest.mark.parametrize(
    ("memory_gib", "said"),
    [("0.2", "1 full-length sequence ("), ("0.3", "2 full-length sequences (")],
)
def test_the_count_of_sequences_that_fit_agrees_with_its_noun(capsys, memory_gib, said):
    assert (
        main(["kv", "--model", "llama-3-8b", "--tokens", "1000", "--memory-gib", memory_gib]) == 0
    )
    assert said in capsys.readouterr().out
