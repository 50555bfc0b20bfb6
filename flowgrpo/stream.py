r"""Generate a long video whose prompt changes mid-stream, with a streaming model: an mp4 and a labelled PNG.

    python -m flowgrpo.stream --prompt "a red circle moving left" --prompt "a red circle moving up" --switch 25
    python -m flowgrpo.stream --metadata assets/prompts/streams_test.jsonl --index 3 --score
    python -m flowgrpo.stream --model PATH --prompt "..." --prompt "..." --switch 41 --num-frames 81 --height 480 \
        --width 832 --out outputs/stream --device cuda

``--model`` is a streaming model directory (:class:`~flowgrpo.models.StreamingWanPipeline`: a ``WanPipeline``
directory plus ``stream_config.json``; default the embedded ``assets/tiny-causal-wan-shapes``). The prompts are
the segments in order; ``--switch`` gives the pixel frame where each segment after the first starts. Or take a
stream's prompts and switch frames from a metadata file of the moving-shapes world (``--metadata``, one JSON stream
per line, ``--index`` picks the line), and with ``--score`` print the long-video rewards of the result against it.

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

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "tiny-causal-wan-shapes"

__all__ = ["main", "segment_sheet"]


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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="streaming model directory")
    p.add_argument("--prompt", action="append", default=[], help="a segment's prompt (repeat, in order)")
    p.add_argument("--switch", type=int, action="append", default=[], help="pixel frame where the next segment starts")
    p.add_argument("--metadata", default=None, help="JSONL of world streams: take prompts and switches from a line")
    p.add_argument("--index", type=int, default=0, help="which line of --metadata")
    p.add_argument("--score", action="store_true", help="with --metadata: print the long-video rewards")
    p.add_argument("--num-frames", type=int, default=None, help="pixel frames (4k+1; default 49, or the metadata's)")
    p.add_argument("--height", type=int, default=None, help="default: the stream config's")
    p.add_argument("--width", type=int, default=None, help="default: the stream config's")
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
        prompts, switches, num_frames = args.prompt, args.switch, args.num_frames or 49
    if args.score and metadata is None:
        raise SystemExit("--score needs --metadata (the rewards judge the stream against it)")
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
    summary = {"model": args.model, "prompts": prompts, "switch_frames": switches, "switch_blocks": out.switch_blocks,
               "num_frames": num_frames, "png": str(folder / "stream.png")}
    if not args.no_mp4:
        write_mp4(video, folder / "stream.mp4", args.fps)
        summary["mp4"] = str(folder / "stream.mp4")
    if args.score:
        import rewards

        result = rewards.load("long_video")(out.videos.cpu(), [metadata["prompt"]], [metadata])
        summary["rewards"] = {k: round(float(v[0]), 4) for k, v in result.components.items()}
        summary["reward"] = round(float(result.scores[0]), 4)
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(main() and 0)
