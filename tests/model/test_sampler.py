"""Sampler behaviour on hand-made logits: greedy, seeds, truncation, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from nanoserve.core.request import Request
from nanoserve.model.kernels import cpu_kernels
from nanoserve.model.sampler import Sampler
from nanoserve.sampling_params import SamplingParams

VOCAB = 50


def make_request(rid: str = "r", prompt=(1, 2, 3), output=(), **params) -> Request:
    request = Request(
        rid, list(prompt), SamplingParams(**params), eos_token_ids=(2,), arrival_time=0.0, max_tokens=100
    )
    for t in output:
        request.append_output_token(t)
    return request


@pytest.fixture
def kernel_module():
    """The C++ kernels' module, for the tests of sample_rows itself."""
    module = cpu_kernels()
    if module is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    return module


@pytest.fixture(params=["pytorch", "cpu-kernel"])
def kernels(request):
    """Every test runs on both sampling paths: PyTorch ops and the C++ kernel's sample_rows."""
    return None if request.param == "pytorch" else request.getfixturevalue("kernel_module")


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax(kernels):
    logits = random_logits(3)
    tokens, logprobs = Sampler(0, kernels).sample(
        logits, [make_request(str(i), temperature=0) for i in range(3)]
    )
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None, None, None]


@pytest.mark.parametrize("vocab", [49152, 1000, 63])
def test_greedy_picks_the_first_of_tied_maxima_anywhere_in_the_row(kernels, vocab):
    """The maximum's search runs 64 tokens at a time, then token by token over the rest of the row."""
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 3).bfloat16().float()
    peak = logits.max() + 1
    places = [
        (0, 0),
        (1, vocab - 1),
        (2, max(vocab // 64 * 64 - 1, 2)),
        (3, vocab // 2),
        (4, vocab // 3),
        (5, 1),
    ]
    for row, column in places:
        logits[row, column] = peak
    logits[4, vocab - 2] = peak  # tied with an earlier one: the first wins, as in torch.argmax
    expected = [column for _, column in places]
    greedy = [make_request(str(i), temperature=0) for i in range(6)]
    tokens, _ = Sampler(0, kernels).sample(logits, greedy)
    assert tokens == logits.argmax(-1).tolist() == expected
    # beside a sampled row, the greedy rows take the sampling path's own maximum (the kernel's, with kernels)
    with_sampled = torch.cat([logits, logits[:1]])
    tokens, _ = Sampler(0, kernels).sample(with_sampled, [*greedy, make_request("s", temperature=1.0)])
    assert tokens[:6] == expected


def test_top_k_one_equals_greedy(kernels):
    logits = random_logits(4, seed=1)
    tokens, _ = Sampler(0, kernels).sample(
        logits, [make_request(str(i), temperature=1.3, top_k=1) for i in range(4)]
    )
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-38, 1e-6])
def test_a_temperature_near_zero_is_greedy(kernels, temperature):
    """Under about 3e-39 the logits over the temperature overflow (NaN probabilities); well before, the
    draw is the argmax but for near ties. Both are greedy, whatever top-k asks for."""
    logits = random_logits(4, seed=2)
    requests = [make_request(str(i), temperature=temperature, top_k=5, top_p=0.9) for i in range(4)]
    tokens, _ = Sampler(0, kernels).sample(logits, requests)
    assert tokens == logits.argmax(-1).tolist()


def test_seeded_request_is_reproducible_whatever_the_batch(kernels):
    logits = random_logits(4, seed=2) * 0.1
    alone = []
    request = make_request("seeded", temperature=1.0, seed=1234)
    for _ in range(8):
        alone.append(Sampler(0, kernels).sample(logits[:1], [request])[0][0])
    batched = []
    request = make_request("seeded", temperature=1.0, seed=1234)
    others = [make_request(f"o{i}", temperature=1.0) for i in range(3)]
    for step in range(8):
        batched.append(Sampler(step, kernels).sample(logits, [request, *others])[0][0])
    assert alone == batched
    assert len(set(alone)) > 1, "sampling at temperature 1 should not be constant"


def test_unseeded_sampling_follows_the_distribution(kernels):
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 1.0] + [float("-inf")] * (VOCAB - 4)])
    sampler = Sampler(0, kernels)
    counts = torch.zeros(VOCAB)
    for _ in range(2000):
        counts[sampler.sample(logits, [make_request(temperature=1.0)])[0][0]] += 1
    expected = torch.softmax(logits[0], -1) * 2000
    assert counts[2] == 0 and counts[4:].sum() == 0
    assert torch.allclose(counts[:4], expected[:4], atol=80)


def test_top_p_and_min_p_cut_the_tail(kernels):
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 5], logits[0, 6], logits[0, 7] = 5.0, 4.0, 0.0
    sampler = Sampler(0, kernels)
    top_p = {sampler.sample(logits, [make_request(temperature=1.0, top_p=0.5)])[0][0] for _ in range(200)}
    assert top_p == {5}
    min_p = {sampler.sample(logits, [make_request(temperature=1.0, min_p=0.2)])[0][0] for _ in range(300)}
    assert min_p == {5, 6}


def test_penalties_push_away_repeated_tokens(kernels):
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 1.0
    logits[0, 8] = 0.9
    assert Sampler(0, kernels).sample(logits, [make_request(temperature=0)])[0] == [7]
    for params in (dict(frequency_penalty=0.5), dict(presence_penalty=0.5), dict(repetition_penalty=2.0)):
        tokens, _ = Sampler(0, kernels).sample(logits, [make_request(output=(7,), temperature=0, **params)])
        assert tokens == [8], params


def test_repetition_penalty_covers_prompt_tokens(kernels):
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    logits[0, 9] = 0.8
    tokens, _ = Sampler(0, kernels).sample(
        logits, [make_request(prompt=(3, 4), temperature=0, repetition_penalty=1.5)]
    )
    assert tokens == [9]


def test_min_tokens_suppresses_eos_and_stop_tokens(kernels):
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0  # eos
    logits[0, 11] = 9.0
    logits[0, 12] = 8.0
    request = make_request(temperature=0, min_tokens=2, stop_token_ids=[11])
    assert Sampler(0, kernels).sample(logits, [request])[0] == [12]
    request = make_request(output=(20, 21), temperature=0, min_tokens=2, stop_token_ids=[11])
    assert Sampler(0, kernels).sample(logits, [request])[0] == [2]


def test_min_tokens_suppresses_every_eos_id(kernels):
    logits = torch.zeros(1, VOCAB)
    logits[0, 2], logits[0, 30], logits[0, 12] = 10.0, 9.0, 8.0
    request = make_request(temperature=0, min_tokens=1)
    request.eos_token_ids = (2, 30)
    assert Sampler(0, kernels).sample(logits, [request])[0] == [12]


def test_logprobs_report_sampled_and_top_tokens(kernels):
    logits = random_logits(2, seed=3)
    tokens, logprobs = Sampler(0, kernels).sample(
        logits, [make_request("a", temperature=0, logprobs=3), make_request("b")]
    )
    expected = torch.log_softmax(logits[0], -1)
    (sampled, sampled_lp), *top = logprobs[0]
    assert sampled == tokens[0] and abs(sampled_lp - expected[sampled].item()) < 1e-5
    assert [t for t, _ in top] == expected.topk(3).indices.tolist()
    assert logprobs[1] is None


def reference_draw(probs: torch.Tensor, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """top-k, top-p over the renormalized top-k mass, then min-p, over a full sort: what the sampler's
    candidate search must reproduce."""
    values, order = probs.sort(descending=True)
    if 0 < top_k < len(values):
        values = values.clone()
        values[top_k:] = 0.0
    before = values.cumsum(0) - values
    keep = (before < top_p * values.sum()) & (values >= min_p * values[0]) & (values > 0)
    keep[0] = True
    kept = torch.where(keep, values, torch.zeros_like(values))
    cdf = kept.cumsum(0)
    return int(order[torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=len(cdf) - 1)])


def test_truncated_draws_match_a_full_sort(kernels):
    """Rows whose kept set lies past the first candidates (flat logits, top-p 0.9) must look again."""
    from nanoserve.model.sampler import CANDIDATES

    vocab = CANDIDATES * 20
    gen = torch.Generator().manual_seed(7)
    cases = [
        dict(top_p=0.9),  # flat rows: needs thousands of candidates
        dict(top_k=40),
        dict(top_k=3 * CANDIDATES, top_p=0.8),
        dict(min_p=0.05),
        dict(min_p=0.0001),  # almost nothing cut: needs the whole vocabulary
        dict(top_k=100, top_p=0.5, min_p=0.1),
    ]
    for scale in (0.05, 1.0, 4.0):
        logits = torch.randn(len(cases), vocab, generator=gen) * scale
        requests = [make_request(str(i), temperature=1.0, seed=100 + i, **c) for i, c in enumerate(cases)]
        for _ in range(5):
            expected_u = [torch.rand(1, generator=r.generator.clone_state())[0].item() for r in requests]
            tokens, _ = Sampler(0, kernels).sample(logits, requests)
            probs = torch.softmax(logits, dim=-1)
            for i, c in enumerate(cases):
                expected = reference_draw(
                    probs[i], c.get("top_k", 0), c.get("top_p", 1.0), c.get("min_p", 0.0), expected_u[i]
                )
                assert tokens[i] == expected, (scale, c)


def test_top_k_draws_follow_the_renormalized_distribution(kernels):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0] + [-1.0] * (VOCAB - 4)])
    sampler = Sampler(0, kernels)
    counts = torch.zeros(VOCAB)
    for _ in range(3000):
        counts[sampler.sample(logits, [make_request(temperature=1.0, top_k=3)])[0][0]] += 1
    expected = torch.softmax(logits[0, :3], -1) * 3000
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3], expected, atol=100)


def test_a_seeded_stream_resumes_from_its_seed_after_k_draws(kernels):
    """One uniform per sampled token: a request restarted with its generator advanced by k draws
    continues the stream exactly (what an engine restart relies on)."""
    logits = random_logits(1, seed=4) * 0.2
    request = make_request(temperature=0.9, top_p=0.95, seed=77)
    stream = [Sampler(0, kernels).sample(logits, [request])[0][0] for _ in range(10)]
    resumed = make_request(temperature=0.9, top_p=0.95, seed=77)
    torch.rand(6, generator=resumed.generator)
    assert [Sampler(1, kernels).sample(logits, [resumed])[0][0] for _ in range(4)] == stream[6:]
    assert len(set(stream)) > 1


# ---- speculative decoding: rows per draft position, verification -----------------------------------


def model_logits(tokens: list[int]) -> torch.Tensor:
    """A stand-in model: the next-token logits depend on the last token only (and repeat, so drafts
    copied from the past are sometimes right)."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(tokens[-1] % 7)) * 1.5


def drafted_logits(request: Request, draft: list[int]) -> torch.Tensor:
    tokens = request.all_token_ids
    return torch.stack([model_logits(tokens + draft[:j]) for j in range(len(draft) + 1)])


def test_verification_keeps_the_drafts_up_to_the_first_mismatch_then_the_sampled_token(kernels):
    a = make_request("a", temperature=0, logprobs=1)
    b = make_request("b", temperature=0)
    logits = torch.full((5, VOCAB), -1.0)
    for row, token in enumerate([4, 5, 9, 6, 8]):  # a's rows: 4 5 9 6; b's row: 8
        logits[row, token] = 3.0
    tokens, logprobs = Sampler(0, kernels).sample_and_verify(logits, [a, b], [[4, 5, 6], []])
    assert tokens == [[4, 5, 9], [8]]
    assert logprobs[1] is None and logprobs[0] is not None
    assert [entries[0][0] for entries in logprobs[0]] == [4, 5, 9]  # one entry per kept token
    expected = torch.log_softmax(logits[2], -1)[9].item()
    assert abs(logprobs[0][2][0][1] - expected) < 1e-5


def test_each_draft_position_sees_the_drafts_before_it_as_output(kernels):
    """A frequency penalty learns of the drafted 7 at the next position, as plain decoding would."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 7], logits[:, 8] = 2.0, 1.0
    request = make_request(temperature=0, frequency_penalty=2.0)
    tokens, _ = Sampler(0, kernels).sample_and_verify(logits, [request], [[7, 7]])
    assert tokens == [[7, 8]]


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=20)])
def test_seeded_sampling_with_drafts_gives_the_tokens_of_plain_sampling(kernels, params):
    """Drawing each verified position with the uniform plain decoding would use there: the same tokens,
    right and wrong drafts alike, and the generator left one draw per token on."""
    plain = make_request(seed=5, **params)
    sampler = Sampler(0, kernels)
    for _ in range(40):
        token = sampler.sample(model_logits(plain.all_token_ids).unsqueeze(0), [plain])[0][0]
        plain.append_output_token(token)

    speculative = make_request(seed=5, **params)
    num_rejected = 0
    while speculative.num_output_tokens < 40:
        n = speculative.num_output_tokens
        draft = plain.output_token_ids[n : n + 2] + [(plain.output_token_ids[n] + 1) % VOCAB]
        draft = draft[: 40 - n - 1]
        logits = drafted_logits(speculative, draft)
        (kept,), _ = sampler.sample_and_verify(logits, [speculative], [draft])
        num_rejected += len(kept) <= len(draft)
        for token in kept:
            speculative.append_output_token(token)
    assert speculative.output_token_ids == plain.output_token_ids
    assert num_rejected > 0 and len(set(plain.output_token_ids)) > 3
    assert speculative.generator is not None and plain.generator is not None
    assert torch.equal(speculative.generator.get_state(), plain.generator.get_state())


def exact_draw(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float
) -> int:
    """The sampling rules in float64 over a full sort, ties in index order (the kernel's order)."""
    masses = torch.exp((logits.double() - logits.max()) / temperature)
    if not (0 < top_k < len(logits) or top_p < 1.0 or min_p > 0.0):
        cdf = masses.cumsum(0)
        return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=len(cdf) - 1))
    values, order = masses.sort(descending=True, stable=True)
    width = top_k if 0 < top_k < len(logits) else len(logits)
    values, order = values[:width], order[:width]
    total = values.sum() if width < len(logits) else masses.sum()
    cumulative = values.cumsum(0)
    keep = ((cumulative - values) < top_p * total) & (values >= min_p * values[0])
    keep[0] = True
    cdf = values[: int(keep.sum())].cumsum(0)
    return int(order[torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=len(cdf) - 1)])


@pytest.mark.parametrize("vocab", [49152, 1000])
def test_kernel_draws_match_exact_sampling_over_a_real_sized_vocabulary(kernel_module, vocab):
    """bf16-rounded logits over 49152 tokens (many ties), peaky and flat rows: the kernel's draws are
    those of float64 arithmetic over a full sort, whether the kept tokens are a few or thousands. 1000
    tokens end in a partial 64-token block, which the kernel pads."""
    rows = 8
    gen = torch.Generator().manual_seed(3)
    cases = [
        (0.8, 0, 1.0, 0.0),
        (0.8, 0, 0.95, 0.0),
        (1.0, 50, 1.0, 0.0),
        (0.7, 0, 1.0, 0.05),
        (1.2, 200, 0.9, 0.01),
        (1.5, 3000, 1.0, 0.0),
        (2.0, 0, 0.99, 0.0),
        (1.0, 0, 1.0, 1e-9),
    ]
    agree = total = 0
    for scale in (0.5, 8.0, 30.0):  # 30: fewer tokens than top-k within 1e-8 of the maximum's mass
        logits = (torch.randn(rows, vocab, generator=gen) * scale).bfloat16().float()
        for temperature, top_k, top_p, min_p in cases:
            uniforms = torch.rand(rows, generator=gen)
            tokens = kernel_module.sample_rows(
                logits, [temperature] * rows, [top_k] * rows, [top_p] * rows, [min_p] * rows, uniforms
            ).tolist()
            for row in range(rows):
                expected = exact_draw(logits[row], temperature, top_k, top_p, min_p, uniforms[row].item())
                agree += tokens[row] == expected
                total += 1
    assert total - agree <= 1, f"{total - agree} of {total} draws differ"


@pytest.mark.parametrize("uniform", [0.0, 0.5, 0.99999994])
def test_kernel_draws_at_the_ends_of_the_uniform_range_match_exact_sampling(kernel_module, uniform):
    """Top-p over flat rows, where thousands of tokens are kept and the draw's target sits at the first or
    the last of them."""
    rows = 8
    logits = (torch.randn(rows, 49152, generator=torch.Generator().manual_seed(5)) * 0.5).bfloat16().float()
    tokens = kernel_module.sample_rows(
        logits, [0.9] * rows, [0] * rows, [0.95] * rows, [0.0] * rows, torch.full((rows,), uniform)
    ).tolist()
    assert tokens == [exact_draw(logits[row], 0.9, 0, 0.95, 0.0, uniform) for row in range(rows)]


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), "all -inf"])
def test_kernel_draws_stay_in_the_vocabulary_for_non_finite_logits(kernel_module, bad):
    vocab = 1000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4))
    if bad == "all -inf":
        logits[:] = float("-inf")
    else:
        logits[:, 700] = bad
    rules = [
        (0.0, 0, 1.0, 0.0),
        (0.8, 0, 1.0, 0.0),
        (0.8, 0, 0.95, 0.0),
        (0.8, 50, 1.0, 0.0),
        (0.8, 0, 1.0, 0.1),
    ]
    temperature, top_k, top_p, min_p = (list(column) for column in zip(*rules, strict=True))
    tokens = kernel_module.sample_rows(logits, temperature, top_k, top_p, min_p, torch.rand(5)).tolist()
    assert all(0 <= token < vocab for token in tokens), tokens


def test_kernel_refuses_rules_that_do_not_match_its_rows(kernel_module):
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="one temperature, top_k, top_p, min_p and uniform per row"):
        kernel_module.sample_rows(logits, [0.8], [0, 0], [1.0, 1.0], [0.0, 0.0], torch.rand(2))
