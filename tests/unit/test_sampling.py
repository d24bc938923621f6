"""generate.choose_tokens: the one sampling rule of both runners (and of the CUDA graph).

Greedy rows take the argmax whatever their temperature; a sampled row's
token depends only on its scores, its temperature, its top_p and its draw
(so a seed repeats itself in any batch); top_p keeps the smallest set of
tokens whose mass reaches it, the most likely always; the draw is an
inverse transform over the kept mass, so a draw of 0 takes the first kept
token in vocabulary order and a draw just below 1 the last.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostd.engine.generate import SamplingParams, choose_tokens, pick_token, request_generator


def rows(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_greedy_rows_take_the_argmax_whatever_their_temperature():
    scores = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 4.9]])
    assert choose_tokens(scores, rows(0.0, 2.0), rows(1.0, 0.1), rows(-1.0, -1.0)).tolist() == [1, 0]


def test_top_p_keeps_the_smallest_nucleus_and_the_draw_walks_it_in_vocabulary_order():
    # probabilities 0.5, 0.3, 0.2 at temperature 1 (log-probabilities as scores)
    scores = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    t, p = rows(1.0), rows(0.7)  # nucleus: 0.5 + 0.3 reaches 0.7; token 0 (0.2) is out
    picks = {float(u): int(choose_tokens(scores, t, p, rows(u))[0]) for u in (0.0, 0.5, 0.7, 0.999)}
    # kept mass 0.8 in vocabulary order: token 1 up to a draw of 0.5 / 0.8 = 0.625, then token 2
    assert picks == {0.0: 1, 0.5: 1, 0.7: 2, 0.999: 2}
    # without top_p every token can come
    assert int(choose_tokens(scores, t, rows(1.0), rows(0.0))[0]) == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.floats(0.05, 2.0), top_p=st.floats(0.05, 1.0),
       rows_before=st.integers(0, 5))
def test_a_row_is_picked_the_same_whatever_else_is_in_the_batch(seed, temperature, top_p, rows_before):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows_before + 1, 50, generator=generator)
    draws = torch.rand(rows_before + 1, generator=generator)
    t = torch.full((rows_before + 1,), temperature)
    p = torch.full((rows_before + 1,), top_p)
    batched = choose_tokens(scores, t, p, draws)[-1]
    alone = choose_tokens(scores[-1:], t[-1:], p[-1:], draws[-1:])[0]
    assert int(batched) == int(alone)
    kept = torch.softmax(scores[-1] / temperature, -1).sort(descending=True)
    rank = int((kept.indices == batched).nonzero())
    assert rank == 0 or float(kept.values[:rank].sum()) < top_p  # inside the nucleus


def test_a_seed_repeats_itself_and_another_seed_differs():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=42)
    first = [pick_token(logits, params, g) for g in [request_generator(params)] for _ in range(20)]
    again = [pick_token(logits, params, g) for g in [request_generator(params)] for _ in range(20)]
    other = SamplingParams(max_tokens=1, temperature=1.0, seed=43)
    third = [pick_token(logits, other, g) for g in [request_generator(other)] for _ in range(20)]
    assert first == again and first != third
    assert request_generator(SamplingParams(max_tokens=1, temperature=0.0)) is None
