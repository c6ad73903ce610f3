"""The contracts of search/beam.py, each on a small hand-checked tensor (milliseconds).

The oracles (test_search.py) check whole searches; these pin the edges the oracles
never reach: a beam with no valid child, ties, rows shorter than k, -0.0, mixed widths.
Written against single-line mutants that survived the suite (issue 15).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from xrec.search.beam import follow_parents, gather_children, mask_beyond, normalize, select_top

INF = math.inf


def test_gather_children_pads_with_a_valid_token_and_marks_it_invalid():
    offsets = torch.tensor([0, 2, 2, 5])        # node 0: 2 children, node 1: none, node 2: 3
    tokens = torch.tensor([10, 11, 20, 21, 22])
    nodes = torch.tensor([[0, 1, 2]])           # [B=1, W=3]
    children = gather_children(offsets, tokens, nodes, max_children=3)
    assert children.is_valid.tolist() == [[[True, True, False], [False, False, False],
                                            [True, True, True]]]
    assert children.first.tolist() == [[0, 2, 2]]
    # padding repeats a token of the array (never out of range); only valid ones count
    assert children.tokens[children.is_valid].tolist() == [10, 11, 20, 21, 22]
    assert children.tokens.tolist() == [[[10, 11, 20], [20, 21, 22], [20, 21, 22]]]


def test_gather_children_clamps_at_the_end_of_the_level():
    offsets = torch.tensor([0, 1, 3])
    tokens = torch.tensor([5, 6, 7])
    children = gather_children(offsets, tokens, torch.tensor([[1, 0]]), max_children=4)
    assert children.tokens.tolist() == [[[6, 7, 7, 7], [5, 6, 7, 7]]]
    assert children.is_valid.sum(-1).tolist() == [[2, 1]]


@pytest.mark.parametrize("mode", ["allowed", "full"])
def test_a_beam_without_a_valid_child_is_all_minus_inf_never_nan(mode):
    """Every candidate masked: "allowed" takes logsumexp over nothing (-inf), and
    -inf - (-inf) is NaN unless the result is masked again."""
    logits = torch.tensor([[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]])             # [B=1, W=2, C=3]
    is_valid = torch.tensor([[[True, False, True], [False, False, False]]])
    full_lse = torch.logsumexp(logits, -1) if mode == "full" else None
    lp = normalize(logits, is_valid, full_lse)
    assert not lp.isnan().any()
    assert lp[0, 1].tolist() == [-INF, -INF, -INF]
    assert lp[0, 0, 1].item() == -INF
    denominator = torch.logsumexp(logits[0, 0] if mode == "full" else logits[0, 0, [0, 2]], -1)
    torch.testing.assert_close(lp[0, 0, [0, 2]], logits[0, 0, [0, 2]] - denominator)


def test_full_normalisation_with_an_infinite_denominator_stays_minus_inf():
    """full_lse of -inf (a row whose whole vocabulary was masked) must not turn
    the masked candidates into NaN either."""
    logits = torch.full((1, 1, 2), -INF)
    lp = normalize(logits, torch.tensor([[[False, False]]]), torch.tensor([[-INF]]))
    assert lp.tolist() == [[[-INF, -INF]]]


def test_allowed_normalisation_sums_to_one_over_the_valid_candidates():
    logits = torch.tensor([[0.0, 1.0, 7.0, 2.0]])
    is_valid = torch.tensor([[True, True, False, True]])
    lp = normalize(logits, is_valid, None)
    assert lp[0, 2].item() == -INF
    torch.testing.assert_close(lp[is_valid].exp().sum(), torch.tensor(1.0))


def test_without_a_mask_nothing_is_masked():
    logits = torch.tensor([[0.0, -INF, 1.0]])
    lse = torch.logsumexp(logits, -1)
    torch.testing.assert_close(normalize(logits, None, None), logits - lse.unsqueeze(-1))
    full_lse = torch.tensor([3.0])
    torch.testing.assert_close(normalize(logits, None, full_lse), logits - 3.0)


def test_a_beam_without_children_is_never_selected_while_valid_candidates_remain():
    """normalize -> select_top, the search's pair: the dead beam's candidates rank last."""
    logits = torch.tensor([[[0.5, 0.1], [9.0, 9.0]]])                      # [B=1, W=2, C=2]
    is_valid = torch.tensor([[[True, True], [False, False]]])
    scores = (normalize(logits, is_valid, None) + torch.tensor([[[0.0], [0.0]]])).flatten(1)
    values, indices = select_top(scores, 3)
    assert indices[0, :2].tolist() == [0, 1]
    assert values[0, 2].item() == -INF and not values.isnan().any()


def test_select_top_orders_best_first_and_ties_by_the_lower_index():
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0, -1.0, 2.0]])
    values, indices = select_top(scores, 5)
    assert indices.tolist() == [[1, 3, 2, 5, 0]]
    assert values.tolist() == [[3.0, 3.0, 2.0, 2.0, 1.0]]


def test_select_top_orders_negative_scores_and_treats_minus_zero_as_zero():
    scores = torch.tensor([[-0.5, -0.0, -2.0, 0.0, -INF, -1e-30]])
    values, indices = select_top(scores, 6)
    assert indices.tolist() == [[1, 3, 5, 0, 2, 4]]   # -0.0 and 0.0 tie: lower index first
    assert values[0, -1].item() == -INF
    # exact float order, not order after rounding (0.0 and -1e-30 are one value plus 1.0)
    assert select_top(torch.tensor([[-1e-30, 0.0, 1e-30]]), 3)[1].tolist() == [[2, 1, 0]]


def test_select_top_ranks_nan_as_minus_inf_whatever_its_sign():
    """A NaN score (an overflowed model: inf - inf) is no result: +NaN (CUDA's and ARM's)
    outranked every real score, -NaN (x86's) ranked below -inf; both now count as -inf."""
    nan = torch.tensor(math.nan)
    for name, value in (("+nan", nan.abs()), ("-nan", -nan.abs())):
        scores = torch.tensor([[-1.0, 0.0, -2.0, -INF, 0.0]])
        scores[0, 1] = scores[0, 4] = value
        values, indices = select_top(scores, 5)
        assert indices.tolist() == [[0, 2, 1, 3, 4]], name   # NaNs tie with -inf, by index
        assert values.tolist() == [[-1.0, -2.0, -INF, -INF, -INF]], name


def test_select_top_works_per_row():
    scores = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    values, indices = select_top(scores, 2)
    assert indices.tolist() == [[2, 1], [0, 1]]
    assert values.tolist() == [[2.0, 1.0], [2.0, 1.0]]


def test_select_top_pads_rows_shorter_than_k_with_minus_inf_at_index_zero():
    scores = torch.tensor([[1.0, 2.0], [4.0, 3.0]])
    values, indices = select_top(scores, 4)
    assert values.tolist() == [[2.0, 1.0, -INF, -INF], [4.0, 3.0, -INF, -INF]]
    assert indices.tolist() == [[1, 0, 0, 0], [0, 1, 0, 0]]
    assert indices.dtype == torch.int64


def test_select_top_exactly_k_candidates_needs_no_padding():
    values, indices = select_top(torch.tensor([[1.0, 2.0]]), 2)
    assert values.tolist() == [[2.0, 1.0]] and indices.tolist() == [[1, 0]]


def test_mask_beyond_keeps_positions_below_each_rows_width():
    values = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    masked = mask_beyond(values, torch.tensor([1, 4]))
    assert masked.tolist() == [[0.0, -INF, -INF, -INF], [4.0, 5.0, 6.0, 7.0]]
    assert mask_beyond(values, None) is values


def test_follow_parents_reorders_each_requests_history():
    history = torch.tensor([[[1, 1], [2, 2], [3, 3]], [[4, 4], [5, 5], [6, 6]]])   # [B=2, W=3, R=2]
    parents = torch.tensor([[2, 2, 0, 1], [1, 0, 0, 2]])                            # [B=2, K=4]
    out = follow_parents(history, parents)
    assert out[..., 0].tolist() == [[3, 3, 1, 2], [5, 4, 4, 6]]
    assert out.shape == (2, 4, 2)


class _FakeFamily:
    """What WorkspaceModel reads from a config; context and decode bytes recorded."""

    beam_kv_shape = (2, 3, 4)          # layers, kv heads, head dim
    d_model = 8
    vocab_size = 1000

    def __init__(self):
        self.calls = []

    def context_bytes(self, num_b, num_l, prefix_len, elem):
        self.calls.append(("context", num_b, num_l, prefix_len, elem))
        return 1_000_000

    def decode_bytes(self, beams, num_l, elem):
        self.calls.append(("decode", beams, num_l, elem))
        return 2_000_000


def _request(input_len=5, prefix_len=1, beam_width=4, num_results=4, normalize="allowed",
             exclude_items=None, item_types=None, exclude_history=False):
    from types import SimpleNamespace
    return SimpleNamespace(input_len=input_len, prefix_len=prefix_len, beam_width=beam_width,
                           num_results=num_results, normalize=normalize,
                           exclude_items=exclude_items, item_types=item_types,
                           exclude_history=exclude_history)


def test_filters_count_their_ids_and_type_sets_in_the_workspace():
    """A filter's bytes grow with the ids it names (excluded items, the prompt it scans)
    and with each distinct type allow-list (one live mask over the trie's nodes)."""
    from xrec.search.workspace import BatchShape, WorkspaceModel

    shape = BatchShape.of([_request(exclude_items=np.arange(10)),
                           _request(input_len=7, exclude_history=True),
                           _request(item_types=("a",)), _request(item_types=("a",)),
                           _request(item_types=("b",))])
    assert (shape.num_filter_ids, shape.num_type_sets) == (10 + 7, 2)
    plain = BatchShape.of([_request() for _ in range(5)])
    assert (plain.num_filter_ids, plain.num_type_sets) == (0, 0)
    model = WorkspaceModel(_FakeFamily(), 2, 10, 3, num_nodes=1000)
    base = model.batch_bytes(plain)
    assert model.batch_bytes(dataclasses.replace(plain, num_filter_ids=100)) > base
    more_ids = model.batch_bytes(dataclasses.replace(plain, num_filter_ids=200))
    assert more_ids - model.batch_bytes(dataclasses.replace(plain, num_filter_ids=100)) == 2 * 24 * 100
    one_set = model.batch_bytes(dataclasses.replace(plain, num_type_sets=1))
    two_sets = model.batch_bytes(dataclasses.replace(plain, num_type_sets=2))
    assert two_sets - one_set == 2 * 1000


def test_batch_shape_is_padded_to_the_longest_request():
    from xrec.search.workspace import BatchShape

    shape = BatchShape.of([_request(input_len=5, beam_width=8),
                           _request(input_len=9, prefix_len=3, num_results=12)])
    assert shape == BatchShape(2, 9, 3, 8, 12, False)
    assert BatchShape.of([_request(), _request(normalize="full")]).has_full_rows
    assert not BatchShape.of([_request(normalize="allowed")]).has_full_rows


def test_workspace_estimate_by_hand():
    """2 requests x W=4 (8 beams), 3 rounds, bf16, 10 children per node."""
    from xrec.search.workspace import BatchShape, WorkspaceModel

    family = _FakeFamily()
    model = WorkspaceModel(family, dtype_bytes=2, max_children=10, rounds=3)
    shape = BatchShape(2, 9, 3, 4, 4, False)
    beam_kv = 2 * 2 * 2 * 8 * 2 * 3 * 4 * 2            # K and V, ping-pong, rounds - 1 = 2
    head = 8 * 10 * 4 + 8 * 10 * (8 * 2 + 16)          # narrow: logits of the 10 candidates only
    select = 2 * 4 * 10 * 12
    assert model.batch_bytes(shape) == 1_000_000 + 2_000_000 + beam_kv + head + select
    assert family.calls == [("context", 2, 9, 3, 2), ("decode", 8, 9, 2)]
    # full normalisation needs whole-vocabulary rows; so does a wide node (4 * 250 >= 1000)
    full = WorkspaceModel(family, 2, 10, 3).batch_bytes(BatchShape(2, 9, 3, 4, 4, True))
    assert full - model.batch_bytes(shape) == 8 * (1000 - 10) * 4
    wide = WorkspaceModel(family, 2, 250, 3).batch_bytes(shape)
    assert wide == 3_000_000 + beam_kv + 8 * 1000 * 4 + 8 * 250 * 32 + 2 * 4 * 250 * 12
    # one round keeps one K/V buffer per round minimum; more results widen the candidates
    one_round = WorkspaceModel(family, 2, 10, 1).batch_bytes(shape)
    assert model.batch_bytes(shape) - one_round == beam_kv // 2
    many = model.batch_bytes(BatchShape(2, 9, 3, 4, 20, False))
    assert many == 3_000_000 + beam_kv + 8 * 20 * 4 + 8 * 20 * 32 + 2 * 4 * 20 * 12


def test_workspace_head_rows_switch_to_the_vocabulary_at_a_quarter_of_it():
    from xrec.search.workspace import BatchShape, WorkspaceModel

    shape = BatchShape(1, 4, 1, 1, 1, False)

    def head_rows(max_children):
        model = WorkspaceModel(_FakeFamily(), 2, max_children, 2)
        rest = 3_000_000 + 2 * 2 * 2 * 1 * 1 * 3 * 4 * 2 + max_children * (8 * 2 + 16) \
            + max_children * 12
        return (model.batch_bytes(shape) - rest) // 4

    assert head_rows(249) == 249 and head_rows(240) == 240
    assert head_rows(250) == 1000


def test_workspace_buffers_keep_their_dtype_and_are_reused_at_the_same_size():
    from xrec.search.workspace_buffers import Workspace

    workspace = Workspace(torch.device("cpu"))
    ids = workspace.take("ids", (3, 2), torch.int64)
    assert ids.dtype == torch.int64 and ids.device.type == "cpu"
    again = workspace.take("ids", (2, 3), torch.int64)
    assert again.data_ptr() == ids.data_ptr() and workspace.num_bytes == 6 * 8
    floats = workspace.take("ids", (6,), torch.float16)   # another dtype: another buffer
    assert floats.dtype == torch.float16 and workspace.num_bytes == 6 * 8 + 6 * 2


def test_root_children_are_a_slice_only_for_a_run_of_consecutive_ids():
    from xrec.catalog import ItemCatalog
    from xrec.search.step import _root_children

    def tables(triples):
        return ItemCatalog.from_arrays(range(len(triples)), triples, vocab_size=16).constraint_tables()

    run = tables([[5, 1, 1], [6, 2, 2], [7, 1, 3], [6, 3, 3]])
    assert _root_children(run) == slice(5, 8)
    gap = tables([[5, 1, 1], [7, 2, 2]])
    assert torch.equal(_root_children(gap), torch.tensor([5, 7]))


def test_search_pieces_make_their_tensors_on_the_device_of_their_inputs():
    """On the meta device (standing in for a GPU, see oracles/devices.py) a tensor made on
    the CPU by default fails."""
    from oracles.devices import only_meta
    from xrec.search.step import _Rows, _widths

    meta = torch.device("meta")
    offsets = torch.tensor([0, 2, 3], device=meta)
    tokens = torch.tensor([4, 5, 6], device=meta)
    with only_meta():
        children = gather_children(offsets, tokens, torch.zeros(2, 3, dtype=torch.long, device=meta), 2)
        values, indices = select_top(torch.zeros(2, 6, device=meta), 4)
        values = mask_beyond(values, _widths([2, 4], meta))
        rows = _Rows([1], 2, meta, None)
    assert children.tokens.device == children.is_valid.device == meta
    assert values.device == indices.device == rows.full_index.device == meta


def test_rec_step_settings_from_the_model_and_the_catalog():
    """The step runs on its model's device, 3 rounds unless told; the LM-head rows of the
    children are used below a quarter of the vocabulary (strictly); a catalog without items
    is refused whatever its depth."""
    from types import SimpleNamespace

    from xrec.catalog import ConstraintTables
    from xrec.search.step import RecStep

    model = SimpleNamespace(device=torch.device("meta"), config=SimpleNamespace(vocab_size=40))
    unconstrained = RecStep(model, None)
    assert (unconstrained.device, unconstrained.rounds, unconstrained.is_narrow) == (model.device, 3, [])
    first = torch.arange(9)
    tables = ConstraintTables((first, first, first), (torch.tensor([0, 9]),) * 3, (9, 10, 11), 40)
    assert RecStep(model, tables, 3).is_narrow == [True, False, False]
    empty = ConstraintTables((first[:0],), (torch.tensor([0, 0]),), (0,), 40, num_levels=1)
    with pytest.raises(ValueError, match="no items"):
        RecStep(model, empty, 1)
