"""Which attention formulation a CUDA step takes, on a machine without a GPU (nothing runs on a device): the pure
selection (`cuda_decode_impl`, `flex_fits`), `resolve_impl` for device "cuda" with formulations skipped, and the
model view the capture registry hands a step kind whose compile failed (`Llama.skipping`)."""

from __future__ import annotations

import pytest
import torch


def test_cuda_decode_selection_is_a_pure_function() -> None:
    from static_decode.core.attention import cuda_decode_impl, flex_fits

    bf16 = torch.bfloat16
    assert cuda_decode_impl(4, 1, 128, bf16, compiling=True) == "flex"  # Llama-3.1-8B decode, compiled
    assert cuda_decode_impl(4, 8, 128, bf16, compiling=True) == "flex"  # a verify chunk of 8
    assert cuda_decode_impl(4, 1, 128, bf16, compiling=False) == "split_key"  # eager flex is the unfused reference
    assert cuda_decode_impl(3, 1, 64, bf16, compiling=True) == "split_key"  # SmolLM2: a group of 3
    assert cuda_decode_impl(4, 1, 96, bf16, compiling=True) == "split_key"  # head_dim not a power of two
    assert cuda_decode_impl(4, 1, 8, bf16, compiling=True) == "split_key"  # head_dim under 16
    assert cuda_decode_impl(4, 1, 128, torch.float64, compiling=True) == "split_key"
    assert cuda_decode_impl(4, 1, 128, bf16, compiling=True, failed={"flex"}) == "split_key"
    assert cuda_decode_impl(4, 1, 128, bf16, compiling=True, failed={"flex", "split_key"}) == "sdpa_folded"
    assert not flex_fits(4, 128, 128, bf16) and flex_fits(1, 127, 16, torch.float16)


def test_cuda_resolution_simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_impl for device "cuda" (no GPU needed: nothing runs): decode and verify rows split the key axis,
    flex inside a compile where it fits; prefill chunks keep sdpa_folded; a formulation in `skip` (it failed to
    compile for the step) is resolved past, named or not."""
    import static_decode.core.attention as attention

    cuda, bf16 = torch.device("cuda"), torch.bfloat16

    def resolve(impl: str, rows: int, groups: int | None = 4, head_dim: int = 128, skip: tuple = ()) -> str:
        return attention.resolve_impl(impl, 1, 8, rows, cuda, head_dim, bf16, groups=groups, skip=skip)

    assert resolve("auto", 4) == "split_key"  # eager
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert resolve("auto", 4) == "flex" and resolve("auto", 4 * 8) == "flex"  # decode; a verify chunk of 8
    assert resolve("auto", 3, groups=3, head_dim=64) == "split_key"
    assert resolve("auto", 4 * 128) == "sdpa_folded"  # a prefill chunk
    assert resolve("auto", 4, groups=None) == "flex"  # groups unknown: a one-token step (rows = G)
    assert resolve("matmul", 4) == "matmul"  # named and never failed: kept
    assert resolve("auto", 4, skip=("flex",)) == "split_key" and resolve("flex", 4, skip=("flex",)) == "split_key"
    assert resolve("auto", 4, skip=("flex", "split_key")) == "sdpa_folded"
    assert attention.resolve_impl("auto", 1, 3, 3, torch.device("cpu"), skip=("flex",)) != "flex"  # CPU unaffected


def test_a_model_view_skips_formulations_and_shares_the_weights() -> None:
    """Llama.skipping: the view the capture registry hands a kind whose compile failed shares every parameter
    (nothing copied), resolves past what it names, and leaves the model itself as it was."""
    from static_decode.model.config import LlamaConfig
    from static_decode.model.llama import Llama

    model = Llama(LlamaConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                              intermediate_size=32, max_position_embeddings=64))
    view = model.skipping(("flex",))
    assert view.attn_skip == ("flex",) and model.attn_skip == ()
    assert all(a is b for a, b in zip(view.parameters(), model.parameters(), strict=True))
    with pytest.raises(ValueError, match="'fastest'"):
        model.skipping(("fastest",))


