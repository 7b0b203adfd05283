"""The fused MoE path (``actors.engine.model.moe`` and its kernels): the Triton kernels under
``TRITON_INTERPRET=1`` against their torch oracles, and every covered architecture's MoE block
with the fused forwards against the transformers block (fp32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from actors.engine.model.kernels.moe_align import moe_align, moe_align_torch  # noqa: E402
from actors.engine.model.kernels.moe_gemm import (  # noqa: E402
    ExpertLayout,
    fused_experts,
    fused_experts_torch,
)
from actors.engine.model.kernels.moe_routing import RoutingSpec, route, route_torch  # noqa: E402
from actors.engine.model.kernels.moe_tiles import TILE_TABLE, TileConfig, pick_config  # noqa: E402
from actors.engine.model.moe import ROUTERS, install_fused_moe  # noqa: E402
from tests.actors.engine.model.moe_models import ARCHS, moe_blocks, moe_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

SPECS = [
    RoutingSpec(4),
    RoutingSpec(4, renormalize=True),
    RoutingSpec(1, renormalize=True),
    RoutingSpec(3, choose_on_logits=True),
    RoutingSpec(5, scale=1.5),
    RoutingSpec(4, scoring="sigmoid", has_bias=True, renormalize=True, renorm_eps=1e-20,
                scale=2.5),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"k{s.top_k}-{s.scoring}-"
                         f"{'logits' if s.choose_on_logits else 'scores'}-"
                         f"{'renorm' if s.renormalize else 'raw'}-{s.scale}")
@pytest.mark.parametrize("tokens,experts", [(1, 8), (19, 24), (64, 60)])
def test_routing_kernel_equals_torch(spec, tokens, experts):
    gen = torch.Generator().manual_seed(tokens * experts)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(DEVICE)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(DEVICE)
    weights, ids = route(logits, spec, bias)
    want_w, want_ids = route_torch(logits, spec, bias)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-6)


def test_routing_kernel_reads_bf16_logits_and_grouped_top_k_goes_to_torch():
    gen = torch.Generator().manual_seed(4)
    # distinct values per row, exact in bf16 (ties may go either way in torch.topk)
    logits = torch.stack([torch.randperm(256, generator=gen)[:16] - 128 for _ in range(9)])
    logits = (logits.float() / 16).to(DEVICE, torch.bfloat16)
    spec = RoutingSpec(2, renormalize=True)
    weights, ids = route(logits, spec, out_dtype=torch.bfloat16)
    want_w, want_ids = route_torch(logits, spec)
    assert torch.equal(ids, want_ids) and weights.dtype == torch.bfloat16
    assert torch.equal(weights, want_w.bfloat16())  # rounded to nearest, as torch casts
    grouped = RoutingSpec(3, num_groups=4, topk_groups=2)
    weights, ids = route(logits, grouped)
    assert torch.equal(ids, route_torch(logits, grouped)[1])
    kept_groups = (ids // 4).unique(dim=None)
    assert all(len(set((row // 4).tolist())) <= 2 for row in ids)  # at most 2 groups a row
    assert kept_groups.numel() >= 1
    with pytest.raises(ValueError, match="bias"):
        route(logits, RoutingSpec(2, scoring="sigmoid", has_bias=True))


@pytest.mark.parametrize("tokens,top_k,experts,block_m",
                         [(1, 1, 4, 16), (5, 2, 8, 16), (37, 4, 16, 16), (300, 8, 64, 32),
                          (129, 6, 7, 64), (1024, 8, 128, 64), (1100, 8, 128, 16)])
def test_align_kernel_equals_torch(tokens, top_k, experts, block_m):
    """Pairs in one tile of 1,024 or 8,192 (read once), and in several (two passes)."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, -1)[1].to(DEVICE)
    if tokens % 2:
        ids = ids.int()  # the router's ids may be int32 or int64
    sorted_pairs, block_expert = moe_align(ids, experts, block_m)
    want_pairs, want_blocks = moe_align_torch(ids, experts, block_m)
    assert torch.equal(block_expert, want_blocks)
    used = int((want_blocks >= 0).sum()) * block_m
    assert torch.equal(sorted_pairs[:used], want_pairs[:used])
    # every pair appears once, in its expert's blocks
    real = want_pairs[:used][want_pairs[:used] < tokens * top_k].long()
    assert sorted(real.tolist()) == list(range(tokens * top_k))
    block_of_row = want_blocks.repeat_interleave(block_m)[:used]
    rows = want_pairs[:used] < tokens * top_k
    assert torch.equal(block_of_row[rows].long(), ids.reshape(-1)[real])


def _experts_case(tokens, top_k, experts, hidden, inter, layout, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    x = rand(tokens, hidden)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, -1)[1].to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE, dtype)
    if layout.transposed:
        gate_up, down = rand(experts, hidden, 2 * inter, scale=0.2), rand(experts, inter, hidden,
                                                                            scale=0.2)
    else:
        gate_up, down = rand(experts, 2 * inter, hidden, scale=0.2), rand(experts, hidden, inter,
                                                                            scale=0.2)
    biases = (rand(experts, 2 * inter), rand(experts, hidden)) if bias else (None, None)
    return (x, ids, weights, gate_up, down, layout, *biases)


LAYOUTS = [(ExpertLayout(), False),
           (ExpertLayout(transposed=True, interleaved=True, activation="swiglu_oai",
                         alpha=1.702, limit=1.5), True)]


@pytest.mark.parametrize("layout,bias", LAYOUTS, ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter",
                         [(1, 1, 4, 32, 16), (5, 2, 4, 32, 48), (40, 4, 8, 64, 48),
                          (17, 3, 6, 48, 40)])
def test_fused_experts_equal_torch(layout, bias, dtype, tokens, top_k, experts, hidden, inter):
    case = _experts_case(tokens, top_k, experts, hidden, inter, layout, dtype, bias)
    got, want = fused_experts(*case), fused_experts_torch(*case)
    assert got.shape == want.shape == (tokens, hidden) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # every rounding step as torch's: only float32 sum order differs
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("config", [c for _, c in TILE_TABLE], ids=str)
def test_every_tile_configuration(config):
    # sizes that are no multiple of any tile: partial K and N tiles in both GEMMs
    hidden = max(config.gate_up[1], config.down[0]) + 16
    inter = max(config.gate_up[0], config.down[1]) + 8
    case = _experts_case(9, 2, 3, hidden, inter, ExpertLayout(), torch.float32, False)
    torch.testing.assert_close(fused_experts(*case, config=config), fused_experts_torch(*case),
                               rtol=1e-5, atol=1e-5)
    assert pick_config(4096, 128).block_m == 64  # Qwen3-30B-A3B, 512 decode rows
    assert pick_config(8 * 16384, 128) == TILE_TABLE[-1][1]  # a prefill step


@pytest.mark.parametrize("group_m", [1, 2, 3])
def test_grouped_tile_order_covers_every_tile(group_m):
    config = TileConfig(16, group_m, (32, 32, 4, 2), (32, 32, 4, 2))
    case = _experts_case(40, 3, 7, 80, 72, ExpertLayout(), torch.float32, False)  # 23 blocks
    torch.testing.assert_close(fused_experts(*case, config=config), fused_experts_torch(*case),
                               rtol=1e-5, atol=1e-5)


SWAPPED = [TileConfig(16, 2, (32, 32, 4, 2), (32, 32, 4, 2), swap=True),
           TileConfig(32, 1, (64, 32, 4, 2), (32, 64, 4, 2), swap=True, tma=True)]


@pytest.mark.parametrize("layout,bias", LAYOUTS, ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", SWAPPED, ids=["swap", "swap-tma"])
def test_swapped_tiles_equal_torch(layout, bias, dtype, config):
    # partial K and N tiles (48 = 32 + 16 columns, 40 = 32 + 8 rows); with tma the
    # descriptor's reads past a tile's rows land in the next rows (or zeros) and are not stored
    case = _experts_case(17, 3, 6, 48, 40, layout, dtype, bias)
    got, want = fused_experts(*case, config=config), fused_experts_torch(*case)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2 * torch.finfo(dtype).eps


def test_tma_only_where_the_layout_allows_it():
    from actors.engine.model.kernels.moe_gemm import tma_layout

    w = torch.zeros(4, 16, 32)
    assert tma_layout(w, ExpertLayout())
    assert not tma_layout(w, ExpertLayout(transposed=True))
    assert not tma_layout(w, ExpertLayout(interleaved=True))
    assert not tma_layout(w[:, :, :6], ExpertLayout())  # rows of 24 bytes
    assert not tma_layout(w.transpose(1, 2), ExpertLayout())


def _block_inputs(model, tokens=29, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, model.config.hidden_size, generator=gen)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_block_equals_hf_block(arch, backend):
    model = moe_model(arch)
    reference = copy.deepcopy(model)
    fused = install_fused_moe(model, backend)
    blocks, ref_blocks = moe_blocks(model), moe_blocks(reference)
    assert len(blocks) == model.config.num_hidden_layers
    assert len(fused.experts) == len(fused.routers) == len(blocks) and not fused.kept
    x = _block_inputs(model)
    with torch.no_grad():
        for ours, theirs in zip(blocks, ref_blocks):
            got, want = ours(x), theirs(x)
            if isinstance(want, tuple):  # gpt-oss returns (hidden, router scores)
                torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
                got, want = got[0], want[0]
            assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
            assert ours.forward.__func__ is theirs.forward.__func__  # the block's own code
    # the fused forwards really run (a broken experts weight changes the output)
    with torch.no_grad():
        blocks[0].experts.down_proj.mul_(2)
        changed = blocks[0](x)
        changed = changed[0] if isinstance(changed, tuple) else changed
        original = ref_blocks[0](x)
        original = original[0] if isinstance(original, tuple) else original
        assert (changed - original).abs().max() > 1e-3


def test_every_router_class_is_covered_by_a_test_model():
    names = {type(m).__name__ for arch in ARCHS for m in moe_model(arch).modules()}
    assert set(ROUTERS) <= names


def test_an_uncovered_activation_keeps_the_hf_experts_with_a_reason(caplog):
    model = moe_model("qwen3_moe", hidden_act="gelu")
    fused = install_fused_moe(model, "torch")
    assert not fused.experts and len(fused.routers) == 2
    assert "activation" in fused.kept["Qwen3MoeExperts"]
    assert "keeps its own forward" in caplog.text


def test_a_rule_that_disagrees_with_the_model_is_not_installed(monkeypatch):
    """The check at install time refuses a router whose rule differs from the model's."""
    from actors.engine.model import moe

    _, *rest = ROUTERS["Qwen3MoeTopKRouter"]
    monkeypatch.setitem(moe.ROUTERS, "Qwen3MoeTopKRouter",
                        (lambda m: RoutingSpec(m.top_k, renormalize=not m.norm_topk_prob),
                         *rest))
    model = moe_model("qwen3_moe")
    reference = copy.deepcopy(model)
    fused = install_fused_moe(model, "triton")
    assert not fused.routers and "router check failed" in fused.kept["Qwen3MoeTopKRouter"]
    x = _block_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(moe_blocks(model)[0](x), moe_blocks(reference)[0](x))


def test_experts_of_a_wrong_layout_are_not_installed(monkeypatch):
    """An experts module whose weights the kernels would read wrongly keeps its forward."""
    model = moe_model("mixtral")
    for block in moe_blocks(model):
        block.experts.is_concatenated = False  # claims interleaved gate/up rows
    fused = install_fused_moe(model, "triton")
    assert not fused.experts and "experts check failed" in fused.kept["MixtralExperts"]


def test_the_parameters_keep_their_names_and_storage():
    model = moe_model("gpt_oss")
    before = {n: p.data_ptr() for n, p in model.state_dict(keep_vars=True).items()}
    install_fused_moe(model, "torch")
    after = {n: p.data_ptr() for n, p in model.state_dict(keep_vars=True).items()}
    assert before == after


def test_a_check_that_raises_keeps_the_module(monkeypatch):
    from actors.engine.model import moe

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(moe, "_experts_forward", broken)
    model = moe_model("olmoe")
    fused = install_fused_moe(model, "torch")
    assert not fused.experts and "no kernel for this shape" in fused.kept["OlmoeExperts"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 8), (5, 3, 40), (9, 8, 1100)])
def test_sum_pairs_equals_torch(dtype, tokens, top_k, hidden):
    from actors.engine.model.kernels.moe_sum import sum_pairs, sum_pairs_torch

    gen = torch.Generator().manual_seed(tokens)
    pairs = torch.randn(tokens * top_k, hidden, generator=gen).to(DEVICE, dtype)
    got = sum_pairs(pairs, top_k, block=512)  # 1100 columns: two full blocks and a partial one
    want = sum_pairs_torch(pairs, top_k)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # one rounding of the float32 sum: equal but where the sum order flips a last bit
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
