"""CGPO's prompt curriculum (arXiv 2605.17807): which prompts an iteration trains on, from what earlier iterations
learned about them; usable with any algorithm (``data.sampling=cgpo``).

Two tables steer the draw, both updated from every iteration's rewards:

* a **per-prompt probability** ``p``: prompts whose group rewards disagreed most (high sample variance — the
  groups GRPO learns from) are drawn more; prompts every sample solves, or none does, less. For the prompts of an
  iteration: their group reward variance (``ddof=1``), capped at ``variance_cap``, min–max normalised over those
  prompts (all ½ when they are equal), floored at ``floor``. Every prompt *not* drawn gains ``N_drawn/|D|`` (capped at 1),
  so nothing is starved. What the draw uses is that raw value averaged with the prompt's last ``history`` raw values,
  clamped to ``[floor, 1]``;
* a **per-category weight** ``w_c`` (GenEval's tags): categories with a low mean reward get more weight,
  ``w_c ← ½·(1 + λ·v_c) + ½·w_c`` with ``v_c = (1/r̄_c) / Σ_c' (1/r̄_c')`` over the categories seen with a reward above 0
  (the others keep theirs); ``r̄_c`` is the authors' running pairwise average ``r̄ ← (r̄ + mean_prompt)/2`` over the
  iteration's prompts of that category, in draw order.

The draw: candidates in a seeded random order, each accepted with probability ``min(1, p·w_c)``, until ``N`` distinct
prompts are accepted. Everything is a function of the run's seed, the iteration and the gathered rewards, so every
process computes the same tables and draws the same prompts without any broadcast (the authors' code updates the
tables on one process only, and the others sample from stale ones). Departures from the authors' code
(``baoteng-li/CGPO``, ``scripts/train_sd3_fast_cgpo.py``): prompts are keyed by their index in the training set, not by
their text; an iteration's prompts are distinct, and accepted prompts beyond ``N`` are not carried over to the next
iteration (so a draw depends on the tables and the seed alone, which makes resuming exact).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["CGPOCurriculum"]


class CGPOCurriculum:
    """The two tables and the draw. See the module docstring.

    Args:
        categories: the category (tag) of every training prompt, in training-set order.
        lam: ``λ`` of the category weight (the authors' 10).
        variance_cap, floor, history: the per-prompt probability's cap on the variance (0.6), floor (0.1) and the
            number of earlier raw values it is averaged with (2).
        ema: weight of the new category weight against the old one (0.5).
    """

    def __init__(self, categories: Sequence[str], *, lam: float = 10.0, variance_cap: float = 0.6, floor: float = 0.1,
                 history: int = 2, ema: float = 0.5) -> None:
        if not categories:
            raise ValueError("CGPO's curriculum needs at least one training prompt")
        self.names = list(dict.fromkeys(str(c) for c in categories))  # first-seen order
        self.category = torch.tensor([self.names.index(str(c)) for c in categories], dtype=torch.long)
        self.lam, self.variance_cap, self.floor, self.history, self.ema = lam, variance_cap, floor, history, ema
        n = len(categories)
        self.raw = torch.ones(n, dtype=torch.float64)  # the last raw probability of every prompt
        self.past = torch.zeros(n, 0, dtype=torch.float64)  # up to `history` raw values before it
        self.p = torch.ones(n, dtype=torch.float64)  # what the draw uses
        self.w = torch.ones(len(self.names), dtype=torch.float64)

    def __len__(self) -> int:
        return self.p.shape[0]

    def acceptance(self) -> torch.Tensor:
        """``[|D|]`` the probability each prompt is accepted when it comes up: ``min(1, p·w_c)``."""
        return (self.p * self.w[self.category]).clamp(max=1.0)

    def draw(self, n: int, generator: torch.Generator, max_rounds: int = 10_000) -> list[int]:
        """``n`` distinct training-set indices (``n ≤ |D|``), from ``generator`` and the tables alone."""
        if n > len(self):
            raise ValueError(f"trainer.prompts_per_iteration={n} distinct prompts from a training set of {len(self)}")
        accept = self.acceptance()
        chosen: list[int] = []
        seen: set[int] = set()
        for _ in range(max_rounds):
            candidates = torch.randperm(len(self), generator=generator)[:n].tolist()
            u = torch.rand(n, generator=generator, dtype=torch.float64)
            for i, x in zip(candidates, u.tolist()):
                if x < accept[i] and i not in seen:
                    chosen.append(i)
                    seen.add(i)
                    if len(chosen) == n:
                        return chosen
        raise RuntimeError(f"CGPO's curriculum accepted {len(chosen)} of {n} prompts in {max_rounds} rounds")

    def update(self, prompt_ids: Sequence[int], rewards: torch.Tensor) -> None:
        """Fold one iteration in: ``prompt_ids`` the ``N`` prompts drawn (in draw order), ``rewards`` ``[N, G]`` their
        groups' rewards (gathered from every process)."""
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        r = torch.as_tensor(rewards, dtype=torch.float64).cpu()
        if r.ndim != 2 or r.shape[0] != ids.shape[0] or r.shape[1] < 2:
            raise ValueError(f"rewards must be [N={ids.shape[0]}, G>=2], got {tuple(r.shape)}")
        if not bool(torch.isfinite(r).all()):
            raise ValueError("CGPO's curriculum got a NaN/inf reward")
        # category weights from the running pairwise average of each category's prompt means
        running = torch.zeros(len(self.names), dtype=torch.float64)
        for c, m in zip(self.category[ids].tolist(), r.mean(dim=1).tolist()):
            running[c] = m if running[c] == 0 else (m + running[c]) / 2
        seen = running > 0
        if bool(seen.any()):
            v = (1 / running[seen]) / (1 / running[seen]).sum()
            self.w[seen] = self.ema * (1 + self.lam * v) + (1 - self.ema) * self.w[seen]
        # raw per-prompt probabilities: drawn prompts from their variance, the others explore
        var = r.var(dim=1, unbiased=True).clamp(max=self.variance_cap)
        span = var.max() - var.min()
        drawn = torch.full_like(var, 0.5) if span == 0 else (var - var.min()) / span
        raw = (self.raw + len(set(ids.tolist())) / len(self)).clamp(max=1.0)
        raw[ids] = drawn.clamp(min=self.floor)
        # what the draw uses: the raw value averaged with the last `history` raw values, then remember it
        if self.past.shape[1]:
            self.p = ((raw + self.past.sum(dim=1)) / (self.past.shape[1] + 1)).clamp(self.floor, 1.0)
        else:
            self.p = raw.clone()
        self.past = torch.cat([self.past, raw.unsqueeze(1)], dim=1)[:, -self.history:] if self.history else self.past
        self.raw = raw

    def diagnostics(self) -> dict[str, float]:
        """Per-category weight and mean acceptance, and the spread of the per-prompt probabilities, for the logs."""
        out = {f"weight/{name}": float(self.w[c]) for c, name in enumerate(self.names)}
        acc = self.acceptance()
        out.update({f"acceptance/{name}": float(acc[self.category == c].mean()) for c, name in enumerate(self.names)})
        out["p_min"], out["p_mean"] = float(self.p.min()), float(self.p.mean())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"raw": self.raw.clone(), "past": self.past.clone(), "p": self.p.clone(), "w": self.w.clone(),
                "names": list(self.names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["names"]) != self.names or state["p"].shape != self.p.shape:
            raise ValueError("the checkpoint's CGPO curriculum is for another training set (data.train_file / "
                             "data.train_tags differ)")
        self.raw, self.past, self.p, self.w = (state[k].clone() for k in ("raw", "past", "p", "w"))
