"""Weight-free rewards: JPEG compressibility ordering and the reward contract."""

import torch

import rewards


def test_jpeg_rewards_order_smooth_above_noisy():
    gen = torch.Generator().manual_seed(0)
    smooth = torch.linspace(0, 1, 64).view(1, 1, 1, 64).expand(2, 3, 64, 64).clone()
    noisy = torch.rand(2, 3, 64, 64, generator=gen)
    images = torch.cat([smooth, noisy])
    comp = rewards.load("jpeg_compressibility")(images, [""] * 4)
    incomp = rewards.load("jpeg_incompressibility")(images, [""] * 4)
    assert comp.scores.shape == (4,) and set(comp.components) == {"jpeg_kb"}
    assert comp.scores[:2].min() > comp.scores[2:].max()
    torch.testing.assert_close(incomp.scores, -comp.scores)
    # uint8 and PIL inputs give the same sizes as float input
    as_uint8 = (images * 255).round().to(torch.uint8)
    torch.testing.assert_close(rewards.load("jpeg_compressibility")(as_uint8, [""] * 4).scores, comp.scores)
