"""``remote``: score with a reward server over HTTP (a reward too big or too foreign to run in the trainer).

``rewards.load("remote", url="http://host:port/score")`` returns a reward that POSTs each batch as JSON and reads
the scores back. Only the standard library is used (``urllib``); nothing is contacted before the first call.

Request (``Content-Type: application/json``)::

    {"prompts": [str, ...], "metadata": [dict | null, ...] | null,
     "media": {"kind": "images" | "videos", "format": "png" | "npz", "data": ...},
     ...extra}                                      # ``extra`` kwarg, e.g. {"reward": "hpsv3"}

* ``format="png"``: ``data`` is a list, per image, of a base64 PNG string; for videos, per clip, of a list of
  base64 PNG frames.
* ``format="npz"``: ``data`` is one base64 string of ``numpy.savez_compressed(media=uint8 array)``, the array
  ``[B, H, W, 3]`` (images) or ``[B, T, H, W, 3]`` (videos).

Response: ``{"scores": [float × B], "components": {name: [float | null × B], ...}}`` (``components`` optional;
``null`` in a component becomes NaN, e.g. a per-tag component on another tag's image). Scores must all be finite.

Failures raise :class:`RemoteRewardError` naming the URL: connection refused, timeout, an HTTP error status (with
the start of the body), a body that is not JSON, missing or non-finite scores, or a wrong count. What is retried,
with exponential back-off (``backoff`` doubled each time, at most ``max_backoff``, or the server's ``Retry-After``):

* an outage — connection refused or reset, a timeout, HTTP 502 / 503 / 504 / 429: ``retries`` times, and beyond that
  for as long as it lasts up to ``retry_window`` seconds (default 120) after the request first failed, so a reward
  server that restarts or is still loading does not stop the run;
* another 5xx (500: the server failed on this request): ``retries`` times only;
* nothing else (other 4xx, a bad answer). ``retries=0`` turns retrying off altogether.

Each retry is logged (logger ``rewards.remote``, WARNING: attempt, wait, error). A score is never made up.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import time
import urllib.error
import urllib.request
from typing import Mapping

import numpy as np
import torch

from ._json import dumps
from .base import RewardOutput, register
from .images import to_uint8_images

__all__ = ["RemoteReward", "RemoteRewardError", "encode_media"]

log = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The remote reward server could not give valid scores (the message names the URL)."""


def _png_b64(array: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def encode_media(images, fmt: str = "png") -> dict:
    """The request's ``media`` field for a batch of images (any reward-contract form) or clips ``[B, T, 3, H, W]``."""
    if fmt not in ("png", "npz"):
        raise ValueError(f"remote reward: format must be 'png' or 'npz', got {fmt!r}")
    if isinstance(images, torch.Tensor) and images.ndim == 5:
        from .video import to_video

        arrays = to_video(images, reward="remote").permute(0, 1, 3, 4, 2).numpy()  # [B, T, H, W, 3] uint8
        kind = "videos"
    else:
        arrays = to_uint8_images(images, reward="remote")
        kind = "images"
    if fmt == "npz":
        if kind == "images" and len({a.shape for a in arrays}) > 1:
            raise ValueError("remote reward: format='npz' needs images of one size; use format='png'")
        buffer = io.BytesIO()
        np.savez_compressed(buffer, media=np.stack(list(arrays)) if kind == "images" else arrays)
        data = base64.b64encode(buffer.getvalue()).decode("ascii")
    elif kind == "images":
        data = [_png_b64(a) for a in arrays]
    else:
        data = [[_png_b64(frame) for frame in clip] for clip in arrays]
    return {"kind": kind, "format": fmt, "data": data}


class RemoteReward:
    """HTTP client of a reward server (protocol in the module doc).

    Args:
        url: the scoring endpoint, ``http(s)://host:port/path``.
        timeout: seconds to wait for one request.
        retries: retries after a connection error, timeout or 5xx / 429 answer, whatever ``retry_window`` (other 4xx
            and bad bodies: none); 0: no retry at all.
        backoff: seconds before the first retry, doubled each time (at most ``max_backoff``).
        retry_window: an outage (connection refused, timeout, HTTP 502 / 503 / 504 / 429) is retried beyond
            ``retries`` for up to this many seconds after the request first failed; 0: only ``retries``.
        max_backoff: the longest wait between two attempts (a ``Retry-After`` answer is honoured up to it too).
        format: ``"png"`` or ``"npz"`` (see module doc).
        batch_size: images per request (None: the whole batch in one request).
        headers: extra HTTP headers (e.g. an authorisation header the server expects).
        extra: extra top-level JSON fields sent with every request (e.g. which reward the server should run).
    """

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int = 2, backoff: float = 1.0, format: str = "png",
                 batch_size: int | None = None, headers: Mapping[str, str] | None = None, extra: Mapping | None = None,
                 retry_window: float = 120.0, max_backoff: float = 15.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward: url must start with http:// or https://, got {url!r}")
        if format not in ("png", "npz"):
            raise ValueError(f"remote reward: format must be 'png' or 'npz', got {format!r}")
        if timeout <= 0 or retries < 0 or backoff < 0 or (batch_size is not None and batch_size < 1):
            raise ValueError(f"remote reward: need timeout > 0, retries >= 0, backoff >= 0, batch_size >= 1 or None; got "
                             f"timeout={timeout}, retries={retries}, backoff={backoff}, batch_size={batch_size}")
        if retry_window < 0 or max_backoff < 0:
            raise ValueError(f"remote reward: need retry_window >= 0 and max_backoff >= 0; got retry_window={retry_window}, "
                             f"max_backoff={max_backoff}")
        self.url, self.timeout, self.retries, self.backoff = url, float(timeout), int(retries), float(backoff)
        self.retry_window, self.max_backoff = float(retry_window), float(max_backoff)
        self.format, self.batch_size = format, batch_size
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **dict(headers or {})}
        self.extra = dict(extra or {})
        clash = sorted(set(self.extra) & {"prompts", "metadata", "media"})
        if clash:
            raise ValueError(f"remote reward: extra fields {clash} would overwrite the request's own fields")

    # ------------------------------------------------------------------------------------------ transport

    def _post(self, payload: dict) -> dict:
        body = dumps(payload).encode("utf-8")  # strict JSON: a NaN in the metadata goes as null
        first_failure = None
        attempt = 0
        while True:
            attempt += 1
            request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
            retry_after, outage = None, True
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                text = err.read().decode("utf-8", "replace")[:500]
                last = RemoteRewardError(f"remote reward {self.url}: HTTP {err.code} {err.reason}: {text}")
                if err.code < 500 and err.code != 429:
                    raise last from err
                retry_after, outage = _retry_after(err.headers), err.code in _OUTAGE_CODES
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                reason = getattr(err, "reason", err)
                last = RemoteRewardError(f"remote reward {self.url}: no answer ({type(reason).__name__}: {reason}); "
                                         f"is the reward server running and reachable? (timeout={self.timeout}s)")
            else:
                try:
                    return json.loads(raw)
                except json.JSONDecodeError as err:
                    raise RemoteRewardError(f"remote reward {self.url}: the answer is not JSON ({err}): "
                                            f"{raw[:200].decode('utf-8', 'replace')!r}") from err
            # a transient failure: wait and retry while within `retries` or (an outage) the retry window
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            left = self.retry_window - (now - first_failure) if outage and self.retries else 0.0
            if attempt > self.retries and left <= 0:
                window = f"; retry_window={self.retry_window:g}s" if outage and self.retries else ""
                raise RemoteRewardError(f"{last} (gave up after {attempt} attempts over {now - first_failure:.1f}s{window})")
            wait = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
            if retry_after is not None:
                wait = min(max(wait, retry_after), self.max_backoff)
            if attempt > self.retries:
                wait = min(wait, max(left, 0.0))  # the last retry lands at the end of the window, not after it
            budget = (f"{left:.{0 if left >= 10 else 1}f}s of the {self.retry_window:g}s retry window left" if left > 0 else
                      f"retry {attempt} of {self.retries}")
            log.warning("remote reward %s: attempt %d failed (%s); retrying in %.1fs (%s)",
                        self.url, attempt, str(last).split(": ", 1)[-1], wait, budget)
            time.sleep(wait)

    def _parse(self, answer, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        where = f"remote reward {self.url}"
        if not isinstance(answer, dict) or "scores" not in answer:
            keys = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
            error = answer.get("error") if isinstance(answer, dict) else None
            said = f"; server says: {error}" if error else ""
            raise RemoteRewardError(f"{where}: the answer has no 'scores' (got {keys}){said}")
        scores = answer["scores"]
        if not isinstance(scores, list) or len(scores) != n:
            raise RemoteRewardError(f"{where}: expected {n} scores, got {len(scores) if isinstance(scores, list) else scores!r}")
        bad = [i for i, s in enumerate(scores) if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s)]
        if bad:
            raise RemoteRewardError(f"{where}: scores at {bad[:8]} are not finite numbers ({[scores[i] for i in bad[:4]]})")
        components = {}
        comps = answer.get("components") or {}
        if not isinstance(comps, dict):
            raise RemoteRewardError(f"{where}: 'components' must be an object {{name: [values]}}, got {type(comps).__name__}")
        for name, values in comps.items():
            if not isinstance(values, list) or len(values) != n:
                raise RemoteRewardError(f"{where}: component {name!r} must be a list of {n} values")
            try:
                components[str(name)] = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
            except (TypeError, ValueError) as err:
                raise RemoteRewardError(f"{where}: component {name!r} holds a non-number ({err})") from err
        return torch.tensor(scores, dtype=torch.float32), components

    # ---------------------------------------------------------------------------------------------- call

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        prompts = list(prompts)
        n = len(prompts)
        if metadata is not None and len(metadata) != n:
            raise ValueError(f"remote reward: {n} prompts but {len(metadata)} metadata entries")
        step = self.batch_size or max(n, 1)
        all_scores, all_components = [], []
        for start in range(0, n, step):
            stop = min(start + step, n)
            payload = {
                **self.extra,
                "prompts": prompts[start:stop],
                "metadata": None if metadata is None else list(metadata[start:stop]),
                "media": encode_media(images[start:stop], self.format),
            }
            count = len(payload["media"]["data"]) if self.format == "png" else stop - start
            if count != stop - start:
                raise ValueError(f"remote reward: {count} images for {stop - start} prompts")
            scores, components = self._parse(self._post(payload), stop - start)
            all_scores.append(scores)
            all_components.append(components)
        names = set(all_components[0]) if all_components else set()
        if any(set(c) != names for c in all_components):
            raise RemoteRewardError(f"remote reward {self.url}: component names differ between requests of one batch")
        return RewardOutput(scores=torch.cat(all_scores) if all_scores else torch.zeros(0),
                            components={k: torch.cat([c[k] for c in all_components]) for k in sorted(names)})

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, format={self.format!r})"


_OUTAGE_CODES = (429, 502, 503, 504)  # the server is (temporarily) not there to answer: worth waiting for


def _retry_after(headers) -> float | None:
    """A ``Retry-After`` header in seconds (its HTTP-date form is ignored)."""
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


register("remote")(RemoteReward)
