"""Writes tests/fixtures/routing/deepseek_v3.npz: transformers' DeepSeek-V3 router choices on random inputs, the
reference tests/test_moe_routing.py holds maxshard's routing (layers/moe.py) to.

Run once, by hand, in a venv with torch and transformers (never dependencies of maxshard or its CI):

    /work/trlvenv/bin/python tools/make_routing_fixture.py

For each case below a `DeepseekV3TopkRouter` (sigmoid scores, group-limited top-k with the
`e_score_correction_bias`, optional renormalisation, routed scaling) gets a random router weight, a random bias
large enough to change choices, and random hidden states; the file keeps, per case NAME, `NAME/hidden` [tokens,
hidden], `NAME/weight` [experts, hidden] (torch's layout: our kernel is its transpose), `NAME/bias` [experts],
`NAME/indices` [tokens, k] and `NAME/weights` [tokens, k] (the router's output, in its own order), and
`NAME/config` (experts, k, n_group, topk_group, norm_topk_prob, routed_scaling_factor).
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "routing" / "deepseek_v3.npz"
HIDDEN, TOKENS = 8, 24

# name: (experts, k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
CASES = {
    "grouped": (16, 4, 4, 2, True, 2.5),  # DeepSeek-V3's shape in small: 8 groups of 32, 4 kept, top-8, 2.5
    "grouped_unnormalized": (12, 3, 3, 2, False, 1.5),
    "ungrouped": (8, 2, 1, 1, True, 1.0),
}


def main() -> None:
    torch.manual_seed(0)
    arrays: dict[str, np.ndarray] = {}
    for name, (experts, k, n_group, topk_group, norm, scale) in CASES.items():
        config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=experts, num_experts_per_tok=k,
                                  n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                                  routed_scaling_factor=scale)
        router = DeepseekV3TopkRouter(config)
        with torch.no_grad():
            router.weight.copy_(torch.randn(experts, HIDDEN) * 0.5)
            router.e_score_correction_bias.copy_(torch.randn(experts) * 0.2)
            hidden = torch.randn(TOKENS, HIDDEN)
            _, weights, indices = router(hidden)
        arrays.update({f"{name}/hidden": hidden.numpy(), f"{name}/weight": router.weight.detach().numpy(),
                       f"{name}/bias": router.e_score_correction_bias.numpy(), f"{name}/indices": indices.numpy(),
                       f"{name}/weights": weights.numpy(),
                       f"{name}/config": np.array([experts, k, n_group, topk_group, int(norm), scale], np.float64)})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez(OUT, **arrays)
    print(f"wrote {OUT} ({', '.join(CASES)})")


if __name__ == "__main__":
    main()
