"""Entry point: ``python train.py [group=option ...] [key=value ...]``; configs in conf/, schemas in flowgrpo/config.py.

    python train.py                                  # the defaults of conf/train.yaml
    python train.py reward=geneval sampler=mix_sde
    accelerate launch --config_file conf/accelerate/multi_gpu.yaml train.py model=sd35_medium
"""

import hydra
from omegaconf import DictConfig

import flowgrpo.config  # noqa: F401  (registers the schemas in Hydra's ConfigStore before composition)
from flowgrpo.launch import check_launch
from flowgrpo.runlog import discard_hydra_dir


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        check_launch()  # a multi-process launch that started one process: refuse it with the fix
        flowgrpo.config.validate(cfg)  # choices, ranges, cross-key checks: fail before the heavy imports
    except BaseException:
        discard_hydra_dir()  # nothing was run: leave no outputs/<date>/<time> behind
        raise
    from flowgrpo.cli import main as run  # torch + diffusers: imported after parsing, so --help / --cfg stay fast

    run(cfg)


if __name__ == "__main__":
    main()
