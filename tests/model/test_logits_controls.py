"""logit_bias, allowed_token_ids and bad_words in the sampler, batched with rows that use none."""

from __future__ import annotations

import torch

from nanoserve.model.sampler import Sampler
from tests.model.test_sampler import VOCAB, make_request, random_logits


def test_logit_bias_moves_the_greedy_choice():
    logits = random_logits(3, seed=3)
    top = logits.argmax(-1).tolist()
    requests = [
        make_request("down", temperature=0, logit_bias={top[0]: -100.0}),
        make_request("plain", temperature=0),
        make_request("up", temperature=0, logit_bias={7: 100.0}),
    ]
    tokens, _ = Sampler(0).sample(logits, requests)
    assert tokens[0] != top[0]
    assert tokens[1] == top[1]
    assert tokens[2] == 7


def test_allowed_token_ids_restrict_sampling():
    logits = random_logits(2, seed=4)
    sampler = Sampler(0)
    seen = set()
    for _ in range(50):
        requests = [make_request("a", temperature=1.5, allowed_token_ids=[3, 9, 11]), make_request("b")]
        tokens, _ = sampler.sample(logits, requests)
        seen.add(tokens[0])
    assert seen <= {3, 9, 11} and len(seen) > 1


def test_bad_words_ban_the_last_token_after_the_rest():
    logits = torch.full((2, VOCAB), -5.0)
    logits[:, 20] = 5.0  # the favourite next token
    logits[:, 21] = 4.0
    single = make_request("single", temperature=0, bad_words_token_ids=[[20]])
    after = make_request("after", output=(30, 31), temperature=0, bad_words_token_ids=[[31, 20], [99, 21]])
    tokens, _ = Sampler(0).sample(logits, [single, after])
    assert tokens == [21, 21]
    elsewhere = make_request("elsewhere", output=(30, 32), temperature=0, bad_words_token_ids=[[31, 20]])
    assert Sampler(0).sample(logits[:1], [elsewhere])[0] == [20]


def test_controls_keep_the_seeded_stream_and_raw_logprobs():
    logits = random_logits(1, seed=5)
    plain = make_request("p", temperature=1.0, seed=7, logprobs=1)
    biased = make_request("b", temperature=1.0, seed=7, logprobs=1, logit_bias={0: -1.0})
    for _ in range(5):
        _, (lp_plain,) = Sampler(0).sample(logits, [plain])
        _, (lp_biased,) = Sampler(0).sample(logits, [biased])
        assert plain.generator.get_state().equal(biased.generator.get_state())
        assert lp_plain[1] == lp_biased[1], "logprobs are those of the model's own distribution"
