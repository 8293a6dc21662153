import torch

from nanoserve.structured_output.bitmask import apply_bitmask


def test_every_bit_decides_its_token_whole_batch_and_subset():
    vocab = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=generator)
    expected = torch.tensor(
        [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for r in range(3)]
    )

    logits = torch.zeros(3, vocab)
    apply_bitmask(logits, [0, 1, 2], bitmask)
    assert torch.equal(torch.isfinite(logits), expected)

    logits = torch.zeros(5, vocab)
    apply_bitmask(logits, [1, 3, 4], bitmask)
    assert torch.equal(torch.isfinite(logits[[1, 3, 4]]), expected)
    assert torch.isfinite(logits[[0, 2]]).all()
