"""Entry point: ``python train.py [group=option ...] [key=value ...]``; configs in conf/, schemas in flowgrpo/config.py.

    python train.py                                  # the defaults of conf/train.yaml
    python train.py reward=geneval sampler=mix_sde
    python train.py --cfg job algo=grpo              # print the composed config and check it, without running
    accelerate launch --config_file conf/accelerate/multi_gpu.yaml train.py model=sd35_medium

A mistake in the command (an unknown key or option, a bad value, a missing path or package, a run dir that holds
another run) ends it with one message and exit status 1 (flowgrpo.errors); FLOWGRPO_DEBUG=1 or HYDRA_FULL_ERROR=1
shows the traceback instead.
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import flowgrpo.config  # noqa: F401  (registers the schemas in Hydra's ConfigStore before composition)
from flowgrpo.errors import reported
from flowgrpo.launch import check_launch, end_launched_process
from flowgrpo.runlog import discard_hydra_dir

CONF = Path(__file__).resolve().parent / "conf"


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported():  # a user error: its message alone; any other error: Hydra's report, as always
        try:
            check_launch()  # a multi-process launch that started one process: refuse it with the fix
            flowgrpo.config.validate(cfg)  # choices, ranges, cross-key checks: fail before the heavy imports
        except BaseException:
            discard_hydra_dir()  # nothing was run: leave no outputs/<date>/<time> behind
            raise
        from flowgrpo.cli import main as run  # torch + diffusers: imported after parsing, so --help / --cfg stay fast

        run(cfg)


def check_printed_config(argv: list[str]) -> int:
    """``--cfg job`` / ``--cfg all`` print the composed config and return without running ``main``: check that config
    as a run would (:func:`flowgrpo.config.validate`) and say the verdict on stderr, so that a config a run would
    refuse is never printed as if it were valid. Returns the exit status (1: refused)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser  # Hydra's own command-line parser, so the overrides match

    args, _ = get_args_parser().parse_known_args(argv)
    if args.cfg not in ("job", "all") or args.multirun:
        return 0
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(args.config_name or "train", overrides=args.overrides)
    try:
        flowgrpo.config.validate(cfg)
    except flowgrpo.config.ConfigError as err:
        reasons = str(err).splitlines()[1:]  # after "invalid config:", one indented line per violation
        print("# REFUSED: a run with this config stops before building anything:", *(f"#{r}" for r in reasons),
              sep="\n", file=sys.stderr)
        return 1
    print("# valid: this config passes the checks a run makes before building anything (flowgrpo.config.validate)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    with reported():  # what Hydra finds while composing (an unknown key or option): one message, with a suggestion
        main()  # a failure leaves with exit status 1 before the lines below
    if any(a in ("--cfg", "-c") or a.startswith("--cfg=") for a in sys.argv[1:]):
        sys.exit(check_printed_config(sys.argv[1:]))
    end_launched_process()  # a finished process of a multi-process launch exits 0 without the interpreter teardown
