r"""Generate a long video whose prompt changes mid-stream, with a streaming model: an mp4 and a labelled PNG.

    python -m flowgrpo.stream --prompt "a red circle moving left" --prompt "a red circle moving up" --switch 25
    python -m flowgrpo.stream --metadata assets/prompts/streams_val.jsonl --index 3 --score
    python -m flowgrpo.stream --model PATH --prompt "..." --prompt "..." --switch 41 --num-frames 81 --height 480 \
        --width 832 --out outputs/stream --device cuda
    python -m flowgrpo.stream --preset self_forcing_wan --set model.stream.checkpoint=PATH/self_forcing_dmd.pt \
        --set model.pretrained=PATH/Wan2.1-T2V-1.3B-Diffusers --prompt "..." --prompt "..." --switch 41

``--model`` is a streaming model directory (:class:`~flowgrpo.models.StreamingWanPipeline`: a ``WanPipeline``
directory plus ``stream_config.json``; default the embedded ``assets/tiny-causal-wan-shapes``). Or ``--preset NAME``
composes ``conf/model/NAME.yaml``, a streaming model's preset (``model.family=causal_wan``: ``self_forcing_wan``,
``longlive_wan``), with ``--set KEY=VALUE`` overrides as on ``train.py``'s command line, and loads it with
:func:`~flowgrpo.models.load_stream_pipeline`; frame count and size then default to the preset's. The prompts are
the segments in order; ``--switch`` gives the pixel frame where each segment after the first starts. Or take a
stream's prompts and switch frames from a metadata file of the moving-shapes world (``--metadata``, one JSON stream
per line, ``--index`` picks the line), and with ``--score`` print the long-video rewards of the result against it
(and ``scored_by``: the reward's rules and version).

Writes ``<out>/stream.mp4`` (``--fps``) and ``<out>/stream.png``: one row per segment, up to ``--strip-frames``
evenly spaced frames of it, labelled with the segment's prompt and frame range. Prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from .gallery import labelled_grid, to_uint8
from .jsonio import dumps

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "assets" / "tiny-causal-wan-shapes"

__all__ = ["compose_preset", "main", "segment_sheet", "streaming_presets"]


def segment_sheet(video: torch.Tensor, prompts: list[str], starts: list[int], strip_frames: int = 12):
    """A labelled PNG of one stream ``[T, 3, H, W]``: one row per segment (its frames evenly spaced)."""
    bounds = list(zip(starts, starts[1:] + [video.shape[0]]))
    shortest = min(e - s for s, e in bounds)
    n = max(1, min(strip_frames, shortest))
    rows = torch.stack([video[np.linspace(s, e - 1, n).round().astype(int)] for s, e in bounds])
    notes = [[f"segment {k}: frames {s}-{e - 1}"] for k, (s, e) in enumerate(bounds)]
    return labelled_grid(rows, prompts, notes, max_frames=n)


def write_mp4(video: torch.Tensor, path: Path, fps: int) -> None:
    try:
        import imageio  # noqa: F401  (diffusers' export_to_video backend)
        import imageio_ffmpeg  # noqa: F401
    except ImportError as err:
        raise SystemExit("writing mp4 needs `pip install imageio imageio-ffmpeg` (or pass --no-mp4)") from err
    from diffusers.utils import export_to_video

    frames = [f.permute(1, 2, 0).numpy() for f in to_uint8(video)]
    export_to_video(frames, str(path), fps=fps)


def _from_metadata(path: str, index: int) -> dict:
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not 0 <= index < len(lines):
        raise SystemExit(f"--index {index}: {path} has {len(lines)} streams")
    return json.loads(lines[index])


def streaming_presets() -> list[str]:
    """The ``conf/model/`` options that are streaming models (``family: causal_wan``)."""
    def streaming(path: Path) -> bool:
        return any(line.split("#")[0].split() == ["family:", "causal_wan"] for line in path.read_text().splitlines())

    return sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml") if streaming(p))


def compose_preset(name: str, overrides: list[str]):
    """The ``model`` node of ``conf/model/NAME.yaml`` with ``overrides`` (Hydra's syntax, e.g.
    ``model.stream.checkpoint=PATH``), composed as ``python train.py model=NAME ...`` composes it, and validated."""
    from hydra import compose, initialize_config_dir

    from .config import STREAM_FAMILY, validate

    presets = streaming_presets()
    if name not in presets:
        raise SystemExit(f"--preset {name}: not a streaming model preset; conf/model/ has {', '.join(presets)}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={name}", *overrides])
    model = validate(cfg.model)
    if model.family != STREAM_FAMILY:
        raise SystemExit(f"--preset {name}: model.family={model.family!r} is not a streaming model ({STREAM_FAMILY})")
    return model


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="streaming model directory (default: the embedded one)")
    p.add_argument("--preset", default=None, help="a streaming model preset, conf/model/NAME.yaml (instead of --model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --preset: a config override (repeat), e.g. model.stream.checkpoint=PATH")
    p.add_argument("--prompt", action="append", default=[], help="a segment's prompt (repeat, in order)")
    p.add_argument("--switch", type=int, action="append", default=[], help="pixel frame where the next segment starts")
    p.add_argument("--metadata", default=None, help="JSONL of world streams: take prompts and switches from a line")
    p.add_argument("--index", type=int, default=0, help="which line of --metadata")
    p.add_argument("--score", action="store_true", help="with --metadata: print the long-video rewards")
    p.add_argument("--num-frames", type=int, default=None,
                   help="pixel frames (4k+1; default: the metadata's, else the preset's, else 49)")
    p.add_argument("--height", type=int, default=None, help="default: the stream config's (a preset's model.height)")
    p.add_argument("--width", type=int, default=None, help="default: the stream config's (a preset's model.width)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/stream", help="output folder")
    p.add_argument("--fps", type=int, default=8)
    p.add_argument("--no-mp4", action="store_true", help="only the PNG")
    p.add_argument("--strip-frames", type=int, default=12, help="frames per segment row of the PNG")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.preset and args.model:
        raise SystemExit("pass either --preset or --model, not both")
    if args.set and not args.preset:
        raise SystemExit("--set overrides a preset's config: pass --preset NAME")
    model_cfg = None
    if args.preset:
        from hydra.errors import ConfigCompositionException

        from .config import ConfigError

        try:
            model_cfg = compose_preset(args.preset, args.set)
        except (ConfigCompositionException, ConfigError) as err:
            raise SystemExit(f"--preset {args.preset}: {err}") from err

    metadata = None
    if args.metadata:
        if args.prompt or args.switch:
            raise SystemExit("pass either --metadata or --prompt/--switch, not both")
        metadata = _from_metadata(args.metadata, args.index)
        prompts = [s["prompt"] for s in metadata["segments"]]
        switches = [int(s["start"]) for s in metadata["segments"][1:]]
        num_frames = args.num_frames or int(metadata["num_frames"])
    else:
        if not args.prompt:
            raise SystemExit("give the segments' prompts with --prompt (repeat it), or --metadata FILE")
        preset_frames = model_cfg.num_frames if model_cfg is not None else None
        prompts, switches, num_frames = args.prompt, args.switch, args.num_frames or preset_frames or 49
    if args.score and metadata is None:
        raise SystemExit("--score needs --metadata (the rewards judge the stream against it)")

    if model_cfg is not None:
        from .models import load_stream_pipeline

        try:
            pipe = load_stream_pipeline(model_cfg, device=args.device)
        except (ValueError, KeyError, OSError) as err:  # a key left unset, a missing or unfit file: named there
            raise SystemExit(f"--preset {args.preset}: {err}") from err
    else:
        args.model = args.model or str(DEFAULT_MODEL)
        if not Path(args.model, "stream_config.json").is_file():
            raise SystemExit(f"--model {args.model}: no stream_config.json there (a streaming model directory holds "
                             "a WanPipeline and its stream settings)")

        from .models import StreamingWanPipeline

        pipe = StreamingWanPipeline.from_pretrained(args.model)
        pipe.pipe.to(args.device)
    out = pipe(prompts, switch_frames=switches, num_frames=num_frames, height=args.height, width=args.width,
               generator=torch.Generator().manual_seed(args.seed))
    video = out.videos[0].cpu()
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    starts = [0] + [min(num_frames - 1, max(0, (b * pipe.config.block_frames - 1) * pipe.temporal_factor + 1))
                    for b in out.switch_blocks]
    segment_sheet(video, prompts, starts, args.strip_frames).save(folder / "stream.png")
    summary = {"model": args.model or f"preset {args.preset}", "prompts": prompts, "switch_frames": switches,
               "switch_blocks": out.switch_blocks, "num_frames": num_frames, "png": str(folder / "stream.png")}
    if not args.no_mp4:
        write_mp4(video, folder / "stream.mp4", args.fps)
        summary["mp4"] = str(folder / "stream.mp4")
    if args.score:
        import rewards

        judge = rewards.load("long_video")
        result = judge(out.videos.cpu(), [metadata["prompt"]], [metadata])
        summary["scored_by"] = judge.describe()
        summary["rewards"] = {k: round(float(v[0]), 4) for k, v in result.components.items()}
        summary["reward"] = round(float(result.scores[0]), 4)
    print(dumps(summary, indent=2))  # strict JSON: a NaN reward component is null
    return summary


if __name__ == "__main__":
    sys.exit(main() and 0)
