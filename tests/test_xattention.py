"""xAttention (docs/model.md) against a one-stage reference.

* shared stage + unshared stage + merge == one softmax over the concatenation of per-beam copies
  of the shared keys and the beam's own keys (ragged prefixes via a -inf bias, GQA, position
  bias; float32 tight, bfloat16 loose);
* each stage's log-sum-exp equals the reference's;
* `attend_beams` (all W queries of a request at once) == attention one beam at a time;
* `BeamKV.reorder` == a naive gather (Python loop) over several reorders, parents unsorted and
  repeated, with writes between reorders as in a real search.

The references are float64 loops over heads, written here independently of xrec.model.
"""

from __future__ import annotations


import pytest
import torch

from xrec.model.attention import attend_beams, merge_states, shared_stage, unshared_stage
from xrec.model.kv import BeamKV

# (max |error| allowed) / (max |reference|): float32 is exact up to rounding, bfloat16 has 8 bits
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
LSE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """max |a - e| <= rtol * max |e|."""
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all()
    err = float((actual - expected).abs().max())
    scale = float(expected.abs().max())
    assert err <= rtol * scale, f"max abs error {err:.3e} > {rtol} * {scale:.3e}"


def _softmax_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row per head: `q [H, Dh]`, `k/v [T, kvH, Dh]`, `bias [H, T]` -> o `[H, Dh]`,
    lse `[H]` in float64. Query head h reads kv head h // (H / kvH)."""
    q, k, v, bias = (t.to(torch.float64) for t in (q, k, v, bias))
    num_heads, num_kv = q.shape[0], k.shape[1]
    group = num_heads // num_kv
    outs, lses = [], []
    for h in range(num_heads):
        scores = (k[:, h // group] @ q[h]) * scale + bias[h]         # [T]
        lse = torch.logsumexp(scores, dim=0)
        outs.append(torch.exp(scores - lse) @ v[:, h // group])
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _random_case(seed: int, dtype: torch.dtype, *, num_batch: int, num_beams: int, num_heads: int,
                 num_kv: int, head_dim: int, lengths: list[int], num_slots: int, has_bias: bool):
    g = torch.Generator().manual_seed(seed)
    num_prefix = max(lengths)

    def rand(*shape, std=1.0):
        return (std * torch.randn(*shape, generator=g)).to(dtype)

    q = rand(num_batch, num_beams, num_heads, head_dim)                     # [B, W, H, Dh]
    shared_k = rand(num_batch, num_kv, num_prefix, head_dim)                # [B, kvH, P, Dh]
    shared_v = rand(num_batch, num_kv, num_prefix, head_dim)
    beam_k = rand(num_batch, num_beams, num_slots, num_kv, head_dim)        # [B, W, S, kvH, Dh]
    beam_v = rand(num_batch, num_beams, num_slots, num_kv, head_dim)
    pad = torch.zeros(num_batch, 1, num_prefix)
    for b, n in enumerate(lengths):
        pad[b, :, n:] = float("-inf")
        # garbage past the end must not leak in
        shared_k[b, :, n:] = 1e3
        shared_v[b, :, n:] = 1e3
    if has_bias:
        shared_bias = 2.0 * torch.randn(num_batch, num_heads, num_prefix, generator=g) + pad   # [B, H, P]
        beam_bias = 2.0 * torch.randn(num_heads, num_slots, generator=g)                     # [H, S]
    else:
        shared_bias, beam_bias = pad, None
    return q, shared_k, shared_v, beam_k, beam_v, shared_bias, beam_bias


CASES = [
    # heads, kv heads, prefix lengths (ragged), slots, position bias
    dict(num_heads=8, num_kv=2, lengths=[5, 1, 3], num_slots=3, has_bias=True),
    dict(num_heads=8, num_kv=2, lengths=[4, 4], num_slots=1, has_bias=False),
    dict(num_heads=8, num_kv=2, lengths=[7, 2], num_slots=2, has_bias=False),    # padding, no bias
    dict(num_heads=4, num_kv=4, lengths=[6, 2, 9], num_slots=2, has_bias=True),
    dict(num_heads=4, num_kv=1, lengths=[1, 3], num_slots=4, has_bias=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_two_stages_and_merge_equal_one_stage(case, dtype):
    params = CASES[case]
    num_batch, num_beams, head_dim, scale = len(params["lengths"]), 5, 16, 0.3
    q, sk, sv, bk, bv, s_bias, b_bias = _random_case(100 + case, dtype, num_batch=num_batch,
                                                     num_beams=num_beams, head_dim=head_dim, **params)
    o_s, lse_s = shared_stage(q, sk, sv, s_bias, scale)
    o_u, lse_u = unshared_stage(q, bk, bv, b_bias, scale)
    assert o_s.dtype == dtype and o_u.dtype == torch.float32   # the slots' sum in float32
    assert lse_s.dtype == lse_u.dtype == torch.float32
    merged = merge_states(o_s, lse_s, o_u, lse_u)
    assert merged.shape == q.shape and merged.dtype == dtype

    num_heads, num_slots = params["num_heads"], params["num_slots"]
    want = torch.zeros(q.shape, dtype=torch.float64)
    want_s = torch.zeros(q.shape, dtype=torch.float64)
    want_lse_s = torch.zeros(q.shape[:3], dtype=torch.float64)
    want_u = torch.zeros(q.shape, dtype=torch.float64)
    want_lse_u = torch.zeros(q.shape[:3], dtype=torch.float64)
    s_bias_full = s_bias.expand(num_batch, num_heads, -1)
    b_bias_full = torch.zeros(num_heads, num_slots) if b_bias is None else b_bias
    for b, length in enumerate(params["lengths"]):
        # per-beam copies of the request's valid shared keys, then the beam's own keys
        prefix_k = sk[b, :, :length].transpose(0, 1)                          # [n, kvH, Dh]
        prefix_v = sv[b, :, :length].transpose(0, 1)
        prefix_bias = s_bias_full[b, :, :length]                              # [H, n]
        for w in range(num_beams):
            k = torch.cat([prefix_k.clone(), bk[b, w]], dim=0)                # [n + S, kvH, Dh]
            v = torch.cat([prefix_v.clone(), bv[b, w]], dim=0)
            bias = torch.cat([prefix_bias, b_bias_full], dim=1)               # [H, n + S]
            want[b, w], _ = _softmax_reference(q[b, w], k, v, bias, scale)
            want_s[b, w], want_lse_s[b, w] = _softmax_reference(q[b, w], prefix_k, prefix_v, prefix_bias, scale)
            want_u[b, w], want_lse_u[b, w] = _softmax_reference(q[b, w], bk[b, w], bv[b, w], b_bias_full, scale)
    _assert_close(merged, want, TOLERANCE[dtype])
    _assert_close(o_s, want_s, TOLERANCE[dtype])
    _assert_close(o_u, want_u, TOLERANCE[dtype])
    _assert_close(lse_s, want_lse_s, LSE_TOLERANCE[dtype])
    _assert_close(lse_u, want_lse_u, LSE_TOLERANCE[dtype])


def test_merge_states_split_anywhere():
    """Merging the partial results of any split of one key set gives the softmax over all of it."""
    g = torch.Generator().manual_seed(9)
    num_heads, head_dim, num_keys = 3, 4, 11
    q = torch.randn(num_heads, head_dim, generator=g)
    k = torch.randn(num_keys, num_heads, head_dim, generator=g)
    v = torch.randn(num_keys, num_heads, head_dim, generator=g)
    bias = 3.0 * torch.randn(num_heads, num_keys, generator=g)
    want, _ = _softmax_reference(q, k, v, bias, 1.0)
    for cut in (1, 5, 10):
        o_a, lse_a = _softmax_reference(q, k[:cut], v[:cut], bias[:, :cut], 1.0)
        o_b, lse_b = _softmax_reference(q, k[cut:], v[cut:], bias[:, cut:], 1.0)
        got = merge_states(o_a.float(), lse_a.float(), o_b.float(), lse_b.float())
        _assert_close(got, want, 2e-6)
        # the merge is symmetric
        _assert_close(merge_states(o_b.float(), lse_b.float(), o_a.float(), lse_a.float()), want, 2e-6)
    # a side with no keys (lse = -inf) contributes nothing
    o_a, lse_a = _softmax_reference(q, k, v, bias, 1.0)
    empty = torch.full((num_heads,), float("-inf"))
    _assert_close(merge_states(o_a.float(), lse_a.float(), torch.zeros(num_heads, head_dim), empty), want, 2e-6)


def test_large_scores_do_not_overflow():
    """Scores far beyond exp's float32 range: the merge works on log-sum-exps, not on sums."""
    q, sk, sv, bk, bv, s_bias, b_bias = _random_case(5, torch.float32, num_batch=2, num_beams=3, num_heads=4,
                                                     num_kv=2, head_dim=8, lengths=[3, 2], num_slots=2,
                                                     has_bias=True)
    q = q * 200.0
    merged = merge_states(*shared_stage(q, sk, sv, s_bias, 1.0), *unshared_stage(q, bk, bv, b_bias, 1.0))
    assert torch.isfinite(merged).all()
    b, w = 1, 2
    k = torch.cat([sk[b, :, :2].transpose(0, 1), bk[b, w]])
    v = torch.cat([sv[b, :, :2].transpose(0, 1), bv[b, w]])
    bias = torch.cat([s_bias[b, :, :2], b_bias], dim=1)
    want, _ = _softmax_reference(q[b, w], k, v, bias, 1.0)
    _assert_close(merged[b, w], want, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("num_heads,num_kv,lengths", [(8, 2, [6, 2, 4]), (4, 4, [3, 3]), (6, 1, [1, 5])])
def test_attend_beams_equals_per_beam_attention(num_heads, num_kv, lengths, dtype):
    g = torch.Generator().manual_seed(num_heads * 10 + num_kv)
    num_batch, num_beams, head_dim, scale = len(lengths), 4, 8, 0.5
    num_keys = max(lengths)
    q = torch.randn(num_batch, num_beams, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_batch, num_kv, num_keys, head_dim, generator=g).to(dtype)
    v = torch.randn(num_batch, num_kv, num_keys, head_dim, generator=g).to(dtype)
    is_ragged = min(lengths) != num_keys
    key_mask = None
    if is_ragged:
        key_mask = torch.zeros(num_batch, 1, 1, num_keys)
        for b, n in enumerate(lengths):
            key_mask[b, ..., n:] = float("-inf")
    got = attend_beams(q, k, v, key_mask, scale)
    assert got.shape == q.shape and got.dtype == dtype
    want = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lengths):
        for w in range(num_beams):
            want[b, w], _ = _softmax_reference(q[b, w], k[b, :, :n].transpose(0, 1), v[b, :, :n].transpose(0, 1),
                                               torch.zeros(num_heads, n), scale)
    _assert_close(got, want, 5e-6 if dtype == torch.float32 else 2e-2)


# ---------------------------------------------------------------------------
# beam reorder
# ---------------------------------------------------------------------------

def _snapshot(beams: BeamKV, num_layers: int, num_written: int) -> list:
    """[layer][k/v][flat beam] -> list of slot tensors, read through the public `layer` views."""
    out = []
    for layer in range(num_layers):
        k, v = beams.layer(layer)
        out.append([[[t[b, w, s].clone() for s in range(num_written)]
                     for b in range(beams.num_batch) for w in range(beams.num_beams)] for t in (k, v)])
    return out


def _assert_same(beams: BeamKV, naive: list, num_layers: int, num_written: int) -> None:
    got = _snapshot(beams, num_layers, num_written)
    for layer in range(num_layers):
        for kv in range(2):
            for j, (a, e) in enumerate(zip(got[layer][kv], naive[layer][kv])):
                for s in range(num_written):
                    assert torch.equal(a[s], e[s]), f"layer {layer}, {'kv'[kv]}, beam {j}, slot {s}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_beam_reorder_equals_naive_gather(dtype):
    g = torch.Generator().manual_seed(17)
    num_layers, num_batch, num_beams, num_slots, num_kv, head_dim = 2, 3, 4, 4, 2, 3
    beams = BeamKV(num_layers, num_batch, num_beams, num_slots, num_kv, head_dim, dtype, torch.device("cpu"))
    total = num_batch * num_beams
    # naive state: naive[layer][k/v][flat beam] = list of per-slot tensors
    naive = [[[[None] * num_slots for _ in range(total)] for _ in range(2)] for _ in range(num_layers)]
    parent_lists = [
        [[3, 3, 0, 1], [2, 0, 0, 2], [1, 3, 2, 0]],     # unsorted, repeated
        [[0, 0, 0, 0], [3, 2, 1, 0], [2, 2, 3, 3]],     # all from one parent; reversed
        [[1, 0, 3, 2], [0, 1, 2, 3], [3, 0, 3, 0]],
    ]
    for round_index, parents in enumerate(parent_lists):
        # this round's K/V of every beam goes to slot `round_index`, as decode_step writes it
        for layer in range(num_layers):
            k, v = beams.layer(layer)                                       # [B, W, S, kvH, Dh]
            for kv, view in enumerate((k, v)):
                fresh = torch.randn(num_batch, num_beams, num_kv, head_dim, generator=g).to(dtype)
                view[:, :, round_index] = fresh
                for j in range(total):
                    naive[layer][kv][j][round_index] = fresh[j // num_beams, j % num_beams].clone()
        _assert_same(beams, naive, num_layers, round_index + 1)
        # reorder: beam j of request b takes the history of beam parents[b][j] of the same request
        flat = torch.tensor([b * num_beams + p for b, row in enumerate(parents) for p in row])
        beams.reorder(flat, num_written=round_index + 1)
        naive = [[[list(naive[layer][kv][int(flat[j])]) for j in range(total)] for kv in range(2)]
                 for layer in range(num_layers)]
        _assert_same(beams, naive, num_layers, round_index + 1)
    # any flat index into B*W is allowed, also across requests
    flat = torch.tensor([11, 0, 5, 5, 2, 9, 1, 1, 7, 4, 10, 3])
    beams.reorder(flat, num_written=len(parent_lists))
    naive = [[[list(naive[layer][kv][int(flat[j])]) for j in range(total)] for kv in range(2)]
             for layer in range(num_layers)]
    _assert_same(beams, naive, num_layers, len(parent_lists))


def test_beam_reorder_identity_and_independence_of_layers():
    """The identity reorder keeps everything; a reorder moves all layers, K and V, the same way."""
    beams = BeamKV(3, 1, 5, 2, 1, 2, torch.float32, torch.device("cpu"))
    for layer in range(3):
        k, v = beams.layer(layer)
        k.copy_(torch.arange(k.numel(), dtype=torch.float32).view(k.shape) + 1000 * layer)
        v.copy_(-k)
    before = [tuple(t.clone() for t in beams.layer(layer)) for layer in range(3)]
    beams.reorder(torch.arange(5), num_written=2)
    for layer in range(3):
        for a, e in zip(beams.layer(layer), before[layer]):
            assert torch.equal(a, e)
    parents = torch.tensor([4, 4, 0, 2, 1])
    beams.reorder(parents, num_written=2)
    for layer in range(3):
        for a, e in zip(beams.layer(layer), before[layer]):
            assert torch.equal(a, e[:, parents])


@pytest.mark.parametrize("num_slots", [0, 1, 3])
def test_beam_kv_layout_and_dtype(num_slots):
    """Two buffers of `[layers, 2 (K, V), B*W, max(R-1, 1), kvH, Dh]` in the given dtype, the
    memory the workspace budgets for (search/workspace.py); a layer is `[B, W, R-1, kvH, Dh]`."""
    beams = BeamKV(3, 2, 4, num_slots, 2, 6, torch.bfloat16, torch.device("cpu"))
    slots = max(num_slots, 1)
    for buffer in beams.buffers:
        assert (buffer.shape, buffer.dtype) == ((3, 2, 8, slots, 2, 6), torch.bfloat16)
    for t in beams.layer(2):
        assert (t.shape, t.dtype) == ((2, 4, slots, 2, 6), torch.bfloat16)


def test_shared_stage_runs_the_cpu_flash_kernel_when_every_head_has_the_same_mask(monkeypatch):
    """No bias, or padding only (`[B, 1, P]`): PyTorch's CPU flash kernel (~3x the speed of
    the scores written out); a per-head position bias (`[B, H, P]`) cannot use it."""
    from xrec.model import attention

    calls = []
    flash = attention._cpu_flash_attention
    monkeypatch.setattr(attention, "_cpu_flash_attention",
                        lambda *args, **kwargs: calls.append(1) or flash(*args, **kwargs))
    q, k, v, _, _, bias, _ = _random_case(7, torch.float32, num_batch=2, num_beams=3, num_heads=4,
                                          num_kv=2, head_dim=8, lengths=[4, 2], num_slots=1,
                                          has_bias=True)
    shared_stage(q, k, v, None, 0.5)
    shared_stage(q, k, v, bias[:, :1], 0.5)
    assert len(calls) == 2
    shared_stage(q, k, v, bias, 0.5)
    assert len(calls) == 2
