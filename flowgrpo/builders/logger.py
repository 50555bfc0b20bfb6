"""Run logging behind one object: :class:`RunLogger` from a ``logger`` node, over accelerate's trackers.

>>> logger = build_logger(cfg.logger, output_dir=run_dir, config=plain_cfg)          # main process  # doctest: +SKIP
>>> logger.log({"reward/mean": 0.41}, step=3)                                                         # doctest: +SKIP
>>> Gallery(run_dir, logger=logger).log(3, prompts, images, rewards=scores)  # galleries go through it # doctest: +SKIP
>>> logger.finish()                                                                                   # doctest: +SKIP

``logger.name`` picks one of :data:`TRACKERS` (or ``none``), each an ``accelerate.tracking`` tracker class
(``WandBTracker``, ``TensorBoardTracker``, ...) started on the main process. Every backend gets the scalars
(:meth:`RunLogger.log`) and the galleries (:meth:`RunLogger.log_gallery`, called by :class:`flowgrpo.gallery.Gallery`),
each the way its viewer shows them:

- ``wandb``: the resolved config; per gallery a ``wandb.Table`` under ``{tag}/gallery`` (step, prompt, image or video,
  every reward component, reward, advantage) and a media panel under ``{tag}/samples`` (a list of ``wandb.Image`` /
  ``wandb.Video`` with the prompt and the scores as captions, the panel the step slider scrolls). The run's files
  live under ``<run dir>/wandb/``. Online, W&B keeps a table twice: as a file of the run
  (``files/media/table/{tag}/gallery_*.table.json``) and as an artifact of the run (``run-<id>-{tag}gallery``). Here
  the table's file references each sample by its path in the run's files (``media/images/...`` /
  ``media/videos/...``, the files of the media panel; W&B itself writes only the media's class name there), so the
  table stands on the run's files alone. Offline, the table is logged as that file only: W&B stages an artifact's
  files outside the run directory and its record names them by absolute path, so a run copied elsewhere before
  ``wandb sync`` could not upload them. An offline run directory holds every file its record references, wherever
  it is copied.
- ``tensorboard``: event files under ``<run dir>/tensorboard/``; the config as text; per gallery the labelled grid
  (prompt and scores drawn above each sample) as the image ``{tag}/gallery``, the captions as a text table
  ``{tag}/captions`` and, for videos, each clip as an animated GIF image ``{tag}/video/NN`` (TensorBoard's image
  dashboard plays GIFs).
- ``mlflow``: a local file store ``<run dir>/mlruns`` (unless ``MLFLOW_TRACKING_URI`` is set; MLflow 3 accepts a file
  store only with ``MLFLOW_ALLOW_FILE_STORE=true``, which the logger sets unless it is set); the config as parameters
  (flattened keys); galleries as artifacts under ``gallery/{tag}/`` (the grid, the media files, a ``captions.json``).
  Needs ``pip install mlflow-skinny`` (or ``mlflow``).
- ``aim``: a repository in the run dir (``<run dir>/.aim``); the config as ``hparams``; per gallery the samples as
  ``aim.Image`` with captions (videos: the labelled grid). Needs ``pip install aim``.
- ``none``: nothing here; the run dir still gets ``metrics.jsonl``, the galleries and their HTML index.

A backend whose package is missing raises an ``ImportError`` naming the package to install and the ``logger=`` to
use instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config import validate

__all__ = ["TRACKERS", "RunLogger", "build_logger"]

# logger.name -> (the module its tracker imports, what to pip install)
TRACKERS = {
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "aim": ("aim", "aim"),
}


@dataclass
class RunLogger:
    """Scalars and galleries to one backend (an ``accelerate.tracking`` tracker, or none); see the module doc.

    Attributes:
        name: ``logger.name``.
        tracker: the started tracker (``WandBTracker``, ``TensorBoardTracker``, ...), None for ``logger=none``.
        run_dir: the run directory (where file-based backends write).
        history: every ``(step, scalars)`` logged, in order (any backend, ``none`` included).
    """

    name: str
    tracker: Any = None
    run_dir: Path | None = None
    history: list[tuple[int, dict]] = field(default_factory=list)

    @property
    def run(self):
        """The ``wandb`` run with ``logger=wandb``, else None."""
        return self.tracker.tracker if self.name == "wandb" and self.tracker is not None else None

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.history.append((step, dict(scalars)))
        if self.tracker is not None:
            self.tracker.log(dict(scalars), step=step)

    def log_gallery(self, page) -> None:
        """One gallery (a :class:`flowgrpo.gallery.GalleryPage`: its files are written) to the backend."""
        if self.tracker is not None:
            getattr(self, f"_gallery_{self.name}")(page)

    def finish(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()
            self.tracker = None

    # ------------------------------------------------------------------ galleries, per backend
    def _gallery_wandb(self, page) -> None:
        import wandb

        def media(path: Path, caption: str | None = None):
            if page.is_video:
                return wandb.Video(str(path), caption=caption, format=path.suffix[1:])
            return wandb.Image(str(path), caption=caption)

        # the table's cells are the panel's media: the panel (logged first) copies each file into the run's files
        # once, and the table's run file references those copies by their path in the run's files
        samples = [media(path, caption) for path, caption in zip(page.media, page.captions)]
        at = page.columns.index(page.media_column)
        table = _run_file_table(wandb)(columns=list(page.columns))
        for row, sample in zip(page.rows, samples):
            table.add_data(*row[:at], sample, *row[at + 1:])
        panel, gallery, step = f"{page.tag}/samples", f"{page.tag}/gallery", int(page.step)
        if not self.run.settings._offline:
            self.run.log({panel: samples, gallery: table}, step=step)
            return
        # offline: the table is a file of the run only. Bound here (as W&B binds a value it logs), W&B does not also
        # log it as an artifact, whose files it would stage outside the run directory and name by absolute path in
        # the run's record: a run copied elsewhere before `wandb sync` could not upload them.
        self.run.log({panel: samples}, step=step, commit=False)
        table.bind_to_run(self.run, gallery, step)
        self.run.log({gallery: table}, step=step)

    def _gallery_tensorboard(self, page) -> None:
        import numpy as np
        from PIL import Image

        writer = self.tracker.writer
        grid = np.asarray(Image.open(page.grid).convert("RGB"))
        writer.add_image(f"{page.tag}/gallery", grid, global_step=int(page.step), dataformats="HWC")
        writer.add_text(f"{page.tag}/captions", _markdown_table(page), global_step=int(page.step))
        if page.is_video:
            from tensorboard.compat.proto.summary_pb2 import Summary

            for i, path in enumerate(page.media):
                gif = path.read_bytes() if path.suffix == ".gif" else page.gif(i)
                h, w = page.frames[i].shape[1:3]
                image = Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=gif)
                summary = Summary(value=[Summary.Value(tag=f"{page.tag}/video/{i:02d}", image=image)])
                writer.file_writer.add_summary(summary, int(page.step))
        writer.flush()

    def _gallery_mlflow(self, page) -> None:
        where = f"gallery/{page.tag}/step-{int(page.step):06d}"
        self.tracker.log_artifact(str(page.grid), artifact_path=f"gallery/{page.tag}")
        for path in page.media:
            self.tracker.log_artifact(str(path), artifact_path=where)
        import mlflow

        mlflow.log_dict({"columns": list(page.columns), "captions": list(page.captions),
                         "media": [p.name for p in page.media],
                         "rows": [list(row) for row in page.rows]},
                        f"{where}/captions.json")

    def _gallery_aim(self, page) -> None:
        import aim
        from PIL import Image

        if page.is_video:
            images = [aim.Image(Image.open(page.grid).convert("RGB"), caption=f"{page.tag} step {page.step}")]
        else:
            images = [aim.Image(Image.open(p).convert("RGB"), caption=c) for p, c in zip(page.media, page.captions)]
        self.tracker.writer.track(images, name=f"{page.tag}/samples", step=int(page.step))


def _markdown_table(page) -> str:
    """The gallery's rows as a Markdown table (TensorBoard's text dashboard renders it)."""
    columns = [c for c in page.columns if c != page.media_column]
    lines = ["| " + " | ".join(["#", *columns]) + " |", "|" + "---|" * (len(columns) + 1)]
    for i, row in enumerate(page.rows):
        cells = [_cell(v) for c, v in zip(page.columns, row) if c != page.media_column]
        lines.append("| " + " | ".join([str(i), *cells]) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _run_file_table(wandb):
    """``wandb.Table`` whose file in the run's files (``media/table/...table.json``) references each media cell by its
    path in the run's files, relative to them (``{"_type": "image-file", "path": "media/images/...", "sha256": ...}``,
    as the run's media panels do), where W&B writes the media's class name (``"Image"``) and keeps the media only in
    the table's artifact. A cell not yet a file of the run (not also in a panel logged before it) is copied in."""
    from wandb.sdk.data_types.base_types.media import Media

    class RunFileTable(wandb.Table):
        _media_run = None  # the run whose files the media cells are referenced in, while the table is bound to it

        def bind_to_run(self, run, key, step, id_=None, ignore_copy_err=None):
            for i, row in enumerate(self.data):
                for j, value in enumerate(row):
                    if isinstance(value, Media) and value._run is not run:
                        value.bind_to_run(run, key, step, id_=f"{i}_{j}", ignore_copy_err=ignore_copy_err)
            self._media_run = run
            try:
                super().bind_to_run(run, key, step, id_=id_, ignore_copy_err=ignore_copy_err)
            finally:
                self._media_run = None

        def _to_table_json(self, max_rows=None, warn=True):
            table = super()._to_table_json(max_rows, warn)
            if self._media_run is not None:  # the run's file (bind_to_run), not the artifact's table
                table["data"] = [[v.to_json(self._media_run) if isinstance(v, Media) else v for v in row]
                                 for row in table["data"]]
            return table

    return RunFileTable


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists become their JSON text (parameters are scalars)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value, default=str)
        else:
            out[name] = value
    return out


def _require(name: str) -> None:
    module, package = TRACKERS[name]
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"logger={name} needs the {module!r} package: pip install {package} "
                          f"(or choose another logger: logger=none, or one of {', '.join(TRACKERS)})")


def build_logger(logger: DictConfig, *, output_dir: str | os.PathLike | None = None,
                 config: dict | None = None) -> RunLogger:
    """A started :class:`RunLogger` from a ``logger`` node (call on the main process only).

    Args:
        logger: the ``logger`` config node (``conf/logger/``).
        output_dir: the run directory: W&B's files, TensorBoard's event files, the MLflow store and the Aim
            repository go under it (None: each backend's default place).
        config: the resolved config, logged as the run's hyperparameters.
    """
    validate(logger)
    name = str(logger.name)
    run_dir = Path(output_dir) if output_dir is not None else None
    if name == "none":
        return RunLogger("none", run_dir=run_dir)
    _require(name)
    run_name = logger.run_name or (run_dir.name if run_dir is not None else None)
    config = dict(config or {})
    from accelerate import PartialState, tracking

    PartialState()  # the trackers log through accelerate's logger, which needs a state (the trainer's, or one)
    if name == "wandb":
        tracker = tracking.WandBTracker(
            logger.project, entity=logger.entity, name=run_name, tags=list(logger.tags),
            mode=os.environ.get("WANDB_MODE", logger.mode), dir=str(run_dir) if run_dir else None, config=config)
        tracker.start()
    elif name == "tensorboard":
        tracker = tracking.TensorBoardTracker("tensorboard", run_dir if run_dir is not None else "runs")
        tracker.start()
        if config:  # as text: TensorBoard's hyperparameters take flat scalars and start a run of their own
            tracker.writer.add_text("config", "```yaml\n" + OmegaConf.to_yaml(config) + "```", 0)
    elif name == "mlflow":
        import mlflow

        if "MLFLOW_TRACKING_URI" not in os.environ and run_dir is not None:
            # a file store of the run's own: MLflow 3 keeps file stores in maintenance mode and refuses them unless
            # allowed (a database store needs the full mlflow package and SQLAlchemy)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        tracker = tracking.MLflowTracker(experiment_name=logger.project, run_name=run_name,
                                         tags={t: "" for t in logger.tags} or None)
        tracker.start()
        if config:
            tracker.store_init_configuration(_flat(config))
    elif name == "aim":
        tracker = tracking.AimTracker(run_name or "flowgrpo", str(run_dir) if run_dir else ".",
                                      experiment=logger.project)
        tracker.start()
        for tag in logger.tags:
            tracker.writer.add_tag(tag)
        if config:
            tracker.store_init_configuration(config)
    else:  # validate() knows the choices; a name added there and not here
        raise ValueError(f"logger.name={name!r} has no tracker here; choose one of {['none', *TRACKERS]}")
    return RunLogger(name, tracker=tracker, run_dir=run_dir)
