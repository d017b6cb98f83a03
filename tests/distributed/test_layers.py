"""Each parallel layer at tensor_parallel_size 2 (two CPU processes, gloo) against the same
layer in one process, from the same full weights: fp32 outputs close (row-parallel sums are
added in another order: tolerance 1e-5), embeddings exact."""
import pytest
import torch

from parallel_testing import child_pids
from nanovllm import distributed
from nanovllm.engine.worker import Workers, exit_with_parent, serve
from nanovllm.layers.embed_head import LMHead, VocabEmbedding
from nanovllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear, tensor_parallel_rank_and_size)

TP = 2
FP32 = dict(rtol=1e-5, atol=1e-5)
TOKENS, HIDDEN = 7, 37
# An odd vocabulary: rank 1's last row is padding.
VOCAB = 321
QKV_SIZES = [48, 16, 16]  # 6 query heads, 2 key/value heads of 8


class Rank:
    @torch.no_grad()
    def call(self, fn, *args):
        return fn(*args)


def rank_main(conn, rank: int, store_port: int) -> None:
    torch.set_num_threads(1)
    exit_with_parent()
    distributed.init(rank, TP, torch.device("cpu"), distributed.local_store(TP, store_port))
    conn.send(("ok", "ready"))
    serve(Rank(), conn, replies=True)
    distributed.destroy()


@pytest.fixture(scope="module")
def ranks():
    """Two processes in one group; ranks.call(fn, *args) runs fn on both, returns both results."""
    store = distributed.local_store(TP)
    workers = Workers.spawn(rank_main, [(rank, store.port) for rank in range(TP)], [f"rank {r}" for r in range(TP)])
    workers.wait_all()

    def call(fn, *args):
        workers.send(("call", fn, *args))
        return workers.wait_all()

    yield call
    workers.stop()
    workers.join()
    assert not child_pids()


def loader(seed: int):
    """load(param, *shape, shard_id=None): loads a full random tensor (the same on every rank)
    into `param` through its weight_loader, which keeps this rank's part."""
    generator = torch.Generator().manual_seed(seed)

    def load(param, *shape, shard_id=None):
        full = torch.randn(shape, generator=generator)
        if shard_id is None:
            param.weight_loader(param, full)
        else:
            param.weight_loader(param, full, "", shard_id)

    return load


def hidden(seed: int, features: int) -> torch.Tensor:
    # A strided view, as a slice of a fused projection would be.
    return torch.randn(TOKENS, 2 * features, generator=torch.Generator().manual_seed(seed + 1000))[:, ::2]


def column(seed):
    layer, load = ColumnParallelLinear(HIDDEN, 22, bias=True), loader(seed)
    load(layer.weight, 22, HIDDEN)
    load(layer.bias, 22)
    return layer(hidden(seed, HIDDEN))


def row(seed):
    layer, load = RowParallelLinear(22, 19, bias=True), loader(seed)
    load(layer.weight, 19, 22)
    load(layer.bias, 19)
    rank, size = tensor_parallel_rank_and_size()
    return layer(hidden(seed, 22).chunk(size, dim=-1)[rank])  # as a column-parallel layer leaves it


def merged(seed):
    layer, load = MergedColumnParallelLinear(HIDDEN, [26, 26]), loader(seed)
    for shard_id in (0, 1):
        load(layer.weight, 26, HIDDEN, shard_id=shard_id)
    return layer(hidden(seed, HIDDEN))


def qkv(seed):
    layer, load = QKVParallelLinear(HIDDEN, head_dim=8, num_heads=6, num_kv_heads=2, bias=True), loader(seed)
    for shard_id, size in zip("qkv", QKV_SIZES):
        load(layer.weight, size, HIDDEN, shard_id=shard_id)
        load(layer.bias, size, shard_id=shard_id)
    return layer(hidden(seed, HIDDEN))


def embedding(seed):
    layer = VocabEmbedding(VOCAB, HIDDEN)
    loader(seed)(layer.weight, VOCAB, HIDDEN)
    return layer(torch.tensor([0, 5, 159, 160, 161, 162, VOCAB - 1, 5]))  # both sides of the shard edge


def lm_head(seed):
    layer = LMHead(VOCAB, HIDDEN)
    loader(seed)(layer.weight, VOCAB, HIDDEN)
    return layer(hidden(seed, HIDDEN))


def parts(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """x's last dimension cut into `sizes`, then each piece into TP rank shards: [piece][rank]."""
    return [piece.chunk(TP, dim=-1) for piece in x.split(sizes, dim=-1)]


def test_column_parallel_concatenates_to_the_full_output(ranks):
    assert not torch.equal(*ranks(column, 0))  # each rank holds its own features
    torch.testing.assert_close(torch.cat(ranks(column, 0), dim=-1), column(0), **FP32)


def test_row_parallel_sums_to_the_full_output_on_every_rank(ranks):
    full = row(1)
    for out in ranks(row, 1):
        torch.testing.assert_close(out, full, **FP32)


@pytest.mark.parametrize("case, sizes", [(merged, [26, 26]), (qkv, QKV_SIZES)], ids=["merged", "qkv"])
def test_merged_projections_shard_each_part(ranks, case, sizes):
    """Rank r holds shard r of every part (q, k, v or gate, up), side by side."""
    full = parts(case(2), sizes)
    for rank, out in enumerate(ranks(case, 2)):
        for piece, shards in zip(out.split([s // TP for s in sizes], dim=-1), full):
            torch.testing.assert_close(piece, shards[rank], **FP32)


def test_vocab_embedding_is_exact(ranks):
    full = embedding(3)
    for out in ranks(embedding, 3):
        assert torch.equal(out, full)


def test_lm_head_gathers_the_logits_on_rank_0(ranks):
    first, other = ranks(lm_head, 4)
    assert other is None
    assert first.shape == (TOKENS, VOCAB)
    torch.testing.assert_close(first, lm_head(4), **FP32)
