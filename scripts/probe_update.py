"""Does one update raise the reward it was computed from? Same prompts, same noise, before and after, as JSON.

    python scripts/probe_update.py --set experiment=stream_grpo_shapes --lrs 3e-5 3e-4 3e-3
    python scripts/probe_update.py --set experiment=kvpo_shapes --batches 2 --fresh --out probe_kvpo.json

For each of ``--batches`` iterations' plans the trainer rolls out, scores and normalises one batch exactly as a run
does (the untrained model), then, for every learning rate of ``--lrs``, restores the untrained weights and a fresh
optimizer, applies ``--updates`` of the algorithm's own updates to that batch (phase 5, as in training), and rolls
the same plan out again from the *same noise* with the updated weights (for an algorithm that samples with an old
policy, e.g. KVPO, with the updated ones all the same). Because the noise is shared, the change of a stream's
reward is caused by the weight change alone, not by sampling.

Each update is also applied with the advantages negated (a control: the same step size, the same gradient
magnitudes, pointing the other way). The ``signal`` of a learning rate is the change with the advantages minus
the change with them negated, per prompt group, mean ± standard error over groups: an update that carries what
the rewards said raises it; an update whose effect on the reward does not depend on the advantages' sign (drift,
float noise, the KL term alone) leaves it at 0. That part, the mean of the two changes, is ``sign_independent``:
what a step of that size costs (or gains) whichever way it points. A fresh optimizer's first AdamW step moves every
trained weight by about the learning rate (``m / sqrt(v)`` is ±1), so a probe measures sign descent, the noisiest
step an Adam run takes. With ``--fresh`` every state is also rolled out from other noise
of the same prompts, and with ``--other`` every state is rolled out on another batch's prompts and noise (what
a run's held-out evaluation asks of an update: prompts it was not computed from).

The same summary is given per reward component (``same/component:NAME``, every row), for a reward that has
components: which of them a step moves.

``rolled`` records each batch as the untrained model rolled it out: its mean reward, the mean over its prompt groups
of their reward std (``group_std``: how far apart the rewards the advantages rank lie) and the share of groups
whose rewards all tie (``tied_groups``: no signal there).

For KVPO the report splits the reference runs (the unrouted model, what generation uses) from the routed
branches. Nothing is written besides the JSON: the run directory is a temporary one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from bench_iteration import emit, scratch_trainer  # noqa: E402

from flowgrpo import jsonio  # noqa: E402

#: noise iterations of the ``--fresh`` rollouts: far from any plan iteration a run or this probe trains on
FRESH = 1_000_000
#: plan (and noise) iterations of the ``--other`` rollouts: another draw of the training prompts than any probed
#: batch's (a prompt may recur by chance, as it does across a run's iterations)
OTHER = 2_000_000


def negated_extras(extras: dict, sign: int) -> dict:
    """A copy of a batch's ``extras`` whose advantage tensors (keys ending in ``advantages``, e.g. streaming AWM's
    per-segment ones) carry ``sign`` too: the control must negate whatever advantages the update reads."""
    return {k: v * sign if k.endswith("advantages") and isinstance(v, torch.Tensor) else v for k, v in extras.items()}


def snapshot(trainer) -> dict:
    """What an update changes: the trainable weights, the optimizer and scheduler, the algorithm's state."""
    return {"params": [p.detach().clone() for p in trainer.params],
            "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
            "scheduler": copy.deepcopy(trainer.lr_scheduler.state_dict()),
            "algorithm": copy.deepcopy(trainer.algorithm.state_dict()),
            "updates": trainer.updates}


def restore(trainer, snap: dict, lr: float) -> None:
    """Back to ``snap`` with learning rate ``lr`` (the schedule's base rate: warm-up still applies)."""
    with torch.no_grad():
        for p, v in zip(trainer.params, snap["params"]):
            p.copy_(v)
    trainer.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
    trainer.lr_scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
    trainer.lr_scheduler.base_lrs = [lr for _ in trainer.lr_scheduler.base_lrs]
    factor = trainer.lr_scheduler.lr_lambdas[0](trainer.lr_scheduler.last_epoch) if hasattr(
        trainer.lr_scheduler, "lr_lambdas") else 1.0
    for group in trainer.optimizer.param_groups:
        group["initial_lr"], group["lr"] = lr, lr * factor
    trainer.algorithm.load_state_dict(copy.deepcopy(snap["algorithm"]))
    trainer.updates = snap["updates"]


def rolled(trainer, plan_iteration: int, noise_iteration: int, *, trained_weights: bool):
    """The plan of ``plan_iteration`` rolled out from the noise of ``noise_iteration`` and scored."""
    batch = trainer.plan(plan_iteration)
    return trainer.score(trainer.rollout(batch, noise_iteration, trained_weights=trained_weights))


def mean_se(values: list[float]) -> dict:
    n = len(values)
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(n) if n > 1 else float("nan")
    return {"mean": round(mean, 5), "se": round(se, 5), "n": n}


def group_means(delta: torch.Tensor, rows: torch.Tensor, group_size: int) -> list[float]:
    """Per prompt group, the mean of ``delta`` over the group's rows selected by ``rows`` (bool ``[n]``); rows where
    ``delta`` is NaN (a reward component the prompt does not define) are left out, and a group with none left is
    NaN."""
    out = []
    for g in range(len(delta) // group_size):
        sel = rows[g * group_size:(g + 1) * group_size]
        if sel.any():
            values = delta[g * group_size:(g + 1) * group_size][sel]
            values = values[~torch.isnan(values)]
            out.append(float(values.mean()) if len(values) else math.nan)
    return out


def row_sets(trainer, n: int) -> dict[str, torch.Tensor]:
    """Which rows each summary covers: all of them, and where the algorithm samples baseline members beside the
    trained ones (``Algorithm.baseline_members``: KVPO's reference runs) those and the trained branches."""
    sets = {"all": torch.ones(n, dtype=torch.bool)}
    G = trainer.cfg.trainer.group_size
    baseline = trainer.algorithm.baseline_members(G).repeat(n // G)
    if bool(baseline.any()):
        sets.update(reference_runs=baseline, branches=~baseline)
    return sets


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", action="append", default=[], help="Hydra override (repeatable)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-5, 3e-4, 3e-3], help="learning rates probed")
    parser.add_argument("--batches", type=int, default=1, help="iterations' plans probed (0, 1, ...)")
    parser.add_argument("--updates", type=int, default=1, help="algorithm updates applied to the batch per probe")
    parser.add_argument("--fresh", action="store_true", help="also roll out every state from other noise")
    parser.add_argument("--other", action="store_true",
                        help="also roll out every state on another batch's prompts (never trained on) and noise")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here (after every probe)")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.updates < 1:
        parser.error("--batches and --updates must be >= 1")
    if any(lr < 0 for lr in args.lrs):
        parser.error("--lrs must be >= 0")
    torch.set_num_threads(args.threads)
    trainer, scratch = scratch_trainer(args.set, "probe-update-")  # noqa: F841 (the run directory lives with it)
    cfg = trainer.cfg
    G = cfg.trainer.group_size
    start = snapshot(trainer)
    report = {"overrides": args.set, "algorithm": trainer.algorithm.name, "rollouts_per_batch": trainer.batch.rollouts,
              "group_size": G, "updates_per_probe": args.updates, "batches": args.batches, "rolled": [],
              "probes": [], "summary": {}}
    # per (lr, sign, set, kind): group-mean reward changes over every batch, kind "same" or "fresh" noise
    changes: dict[tuple, list[float]] = {}
    sets = row_sets(trainer, trainer.batch.rollouts_per_process)
    for b in range(args.batches):
        t0 = time.perf_counter()
        restore(trainer, start, float(cfg.trainer.lr))  # every batch is rolled out by the untrained model
        base = trainer.advantage(rolled(trainer, b, b, trained_weights=False))
        fresh0 = rolled(trainer, b, FRESH + b, trained_weights=True) if args.fresh else None
        other0 = rolled(trainer, OTHER + b, OTHER + b, trained_weights=True) if args.other else None
        spread = base.rewards.double().cpu().view(-1, G).std(1)
        rolled_batch = {"batch": b, "reward": round(float(base.rewards.double().mean()), 5),
                        "group_std": round(float(spread.mean()), 5),
                        "tied_groups": round(float((spread == 0).double().mean()), 5)}
        report["rolled"].append(rolled_batch)
        print(f"batch {b}: reward {rolled_batch['reward']:.4f} (group std {rolled_batch['group_std']:.4f}, groups "
              f"with no spread {rolled_batch['tied_groups']:.2f}), {time.perf_counter() - t0:.0f} s", flush=True)
        for lr in args.lrs:
            for sign in (1, -1):
                t0 = time.perf_counter()
                restore(trainer, start, lr)
                batch = dataclasses.replace(base, advantages=base.advantages * sign,
                                            global_advantages=base.global_advantages * sign,
                                            extras=negated_extras(base.extras, sign))
                train = {}
                for u in range(args.updates):
                    train = trainer.update(batch, b)
                after = rolled(trainer, b, b, trained_weights=True)
                moved = math.sqrt(sum(float((p.detach() - v).pow(2).sum()) for p, v in zip(trainer.params, start["params"])))
                probe = {"batch": b, "lr": lr, "advantage_sign": sign, "weight_change_norm": round(moved, 6),
                         "train": {k: round(v, 6) for k, v in train.items()}}
                for kind, before, now in (("same", base, after),
                                          ("fresh", fresh0, rolled(trainer, b, FRESH + b, trained_weights=True)
                                           if args.fresh else None),
                                          ("other", other0, rolled(trainer, OTHER + b, OTHER + b,
                                                                   trained_weights=True) if args.other else None)):
                    if before is None:
                        continue
                    delta = (now.rewards - before.rewards).double().cpu()
                    for component in sorted(now.components or {}):  # what the change is made of, all rows
                        part = (now.components[component] - before.components[component]).double().cpu()
                        changes.setdefault((lr, sign, f"component:{component}", kind), []).extend(
                            group_means(part, sets["all"], G))
                    for name, rows in sets.items():
                        per_group = group_means(delta, rows, G)
                        changes.setdefault((lr, sign, name, kind), []).extend(per_group)
                        probe[f"{kind}/{name}/before"] = round(float(before.rewards.double().cpu()[rows].mean()), 5)
                        probe[f"{kind}/{name}/change"] = round(statistics.fmean(per_group), 5)
                        probe[f"{kind}/{name}/group_changes"] = [round(v, 5) for v in per_group]
                probe["seconds"] = round(time.perf_counter() - t0, 1)
                report["probes"].append(probe)
                print(f"  lr {lr:g} sign {sign:+d}: same-noise change {probe['same/all/change']:+.4f}, weights moved "
                      f"{moved:.3g}, {probe['seconds']:.0f} s", flush=True)
                report["summary"] = summarise(changes, args.lrs, sets, args.fresh, args.other)
                emit_quietly(report, args.out)
    return emit(report, args.out)


def summarise(changes: dict, lrs: list[float], sets: dict, fresh: bool, other: bool = False) -> dict:
    """Per learning rate: the mean change with the advantages, with them negated, their paired difference
    (``signal``: what the update took from the rewards) and their mean (``sign_independent``: what a step of that
    size does whichever way it points)."""
    out = {}
    for lr in lrs:
        row = {}
        components = sorted({k[2] for k in changes if k[0] == lr and k[2].startswith("component:")})
        for kind in ("same",) + (("fresh",) if fresh else ()) + (("other",) if other else ()):
            for name in [*sets, *components]:
                plus, minus = changes.get((lr, 1, name, kind)), changes.get((lr, -1, name, kind))
                if not plus or not minus or len(plus) != len(minus):
                    continue
                pairs = [(p, m) for p, m in zip(plus, minus) if not (math.isnan(p) or math.isnan(m))]
                if not pairs:  # a component no probed group defines
                    continue
                plus, minus = [p for p, _ in pairs], [m for _, m in pairs]
                row[f"{kind}/{name}"] = {"with_advantages": mean_se(plus), "negated": mean_se(minus),
                                         "signal": mean_se([p - m for p, m in zip(plus, minus)]),
                                         "sign_independent": mean_se([(p + m) / 2 for p, m in zip(plus, minus)])}
        out[f"{lr:g}"] = row
    return out


def emit_quietly(report: dict, out: Path | None) -> None:
    """Write the report so far (an interrupted probe keeps what it measured)."""
    if out:
        Path(out).write_text(jsonio.dumps(report, indent=2))


if __name__ == "__main__":
    main()
