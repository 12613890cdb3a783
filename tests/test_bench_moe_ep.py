"""benchmarks/engine/bench_moe_ep.py's pure parts: its timed copy of MoEBlock.forward gives the
block's output and expert counts (one process, and two EP ranks whose parts add up to it),
the imbalance and spread arithmetic, and a --quick run of the EP=1 engine that writes the
result and the plot (the two-rank engines run in the benchmark itself)."""

import json

import torch

from splitserve.benchmarks.engine import bench_moe_ep as bench
from splitserve.engine.models.loader import load_model
from splitserve.engine.models.moe import MoEBlock
from splitserve.engine.parallel.group import TPGroup


class _PartialEP(TPGroup):
    """An EP rank whose all-reduce returns its own part: the test adds the parts up."""

    def all_reduce(self, t, op="sum", timeout_s=None):
        return t


def _blocks(model) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def test_timed_forward_is_the_blocks_forward(tmp_path):
    folder = bench.model_folder(tmp_path, bench.QUICK_SHAPE, 256)
    whole = load_model(folder, load_format="dummy")
    ranks = [load_model(folder, load_format="dummy",
                        group=_PartialEP(r, 2, torch.device("cpu"), pg=object(), expert_parallel=True))
             for r in range(2)]
    x = torch.randn(7, bench.QUICK_SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0))
    clock = bench.Clock()
    with torch.no_grad():
        for i, block in enumerate(_blocks(whole)):
            want = block(x)
            counts = block.expert_tokens.clone()
            got = bench.timed_moe_forward(block, x, clock)
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            assert torch.equal(block.expert_tokens, counts) and int(counts.sum()) == 7 * 2  # top 2
            parts = [bench.timed_moe_forward(_blocks(r)[i], x, clock) for r in ranks]
            torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-6, rtol=1e-5)
            assert all(torch.equal(_blocks(r)[i].expert_tokens, counts) for r in ranks)  # replicated router
    n = 3 * len(_blocks(whole))
    assert all(clock.calls[p] == n for p in ("dispatch", "experts", "combine", "layer")) and len(clock.counts) == n
    assert clock.seconds["layer"] >= clock.seconds["experts"] > 0


def test_imbalance_and_spread_arithmetic():
    assert bench.max_over_mean(torch.tensor([2, 2, 2, 2])) == 1.0
    assert bench.max_over_mean(torch.tensor([8, 0, 0, 0])) == 4.0
    assert bench.rank_pairs(torch.tensor([1, 2, 3, 4]), 2) == [3, 7]
    assert bench.spread([10.0, 12.0, 15.0]) == 1.5
    many = bench.uniform_imbalance(10000, 32, 4, draws=5)
    few = bench.uniform_imbalance(8, 32, 4, draws=50)
    assert 1.0 < many < 1.2 < few <= 32 / 4  # chance alone: even with many tokens, lumpy with few
    assert bench.decode_routing([torch.tensor([4, 0, 2, 2])], 2) == {"expert_max_over_mean": 2.0,
                                                                      "rank_pairs_max_over_mean": 1.0}


def test_quick_run_writes_result_and_plot(tmp_path):
    out = tmp_path / "moe_ep_cpu.json"
    forward = MoEBlock.forward
    assert bench.main(["--quick", "--configs", "ep1", "--batches", "1", "2", "--out", str(out)]) == 0
    assert MoEBlock.forward is forward  # the timed copy is taken out again
    result = json.loads(out.read_text())
    assert [(r["config"], r["batch"]) for r in result["rows"]] == [("ep1", 1), ("ep1", 2)]
    for r in result["rows"]:
        layer = r["moe_layer"]
        assert r["steps"] == 2 and r["step_ms"] > 0 and 0 < r["moe_share_of_step"] < 1
        assert layer["layer_us"] >= layer["experts_us"] > 0 and layer["decoder_layer_us"] >= layer["layer_us"]
    imb = result["prompt_imbalance"]
    assert imb["one_forward"] and imb["prompts"] == len(bench.PROMPTS) and imb["tokens"] > len(bench.PROMPTS)
    assert set(imb["max_over_mean_per_layer"]) == {"0", "1"}
    assert all(1.0 <= v <= 8 / 2 for v in imb["max_over_mean_per_layer"].values())
    assert "random" in imb["weights"] and isinstance(result["sustained"], bool)
    assert out.with_suffix(".png").stat().st_size > 0
