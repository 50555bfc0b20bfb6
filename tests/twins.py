"""Helpers shared by the tests: tiny random-initialised checkpoints (saved like hub checkpoints, CPU seconds) and a
launcher of fresh multi-process CPU runs."""

from __future__ import annotations

from pathlib import Path


def suite_threads() -> int:
    """Torch threads a test computes on: 1 on a pytest-xdist worker (tests/conftest.py), else 2."""
    import os

    return 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def byte_level_clip_tokenizer():
    """A tiny working CLIP tokenizer over the 256 byte-level symbols (built in memory: no model hub offline)."""
    from flowgrpo.models.tiny import tiny_clip_tokenizer  # tests may import every package; one builder

    return tiny_clip_tokenizer()


def save_tiny_clip(path: Path) -> Path:
    """A tiny transformers CLIP (model + tokenizer + 32-px image processor) saved at ``path``; its weights are drawn
    from torch's global RNG, so seed before calling for reproducible twins."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    tok = byte_level_clip_tokenizer()
    CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2),
        projection_dim=16,
    )).save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return Path(path)


def _run_then_leave_the_group(fn, *args) -> None:
    """``fn(*args)`` in a launched process, then the end of a finished launched process that ``train.py`` has
    (:func:`flowgrpo.launch.end_launched_process`: exit 0 without the interpreter's teardown, where gloo can abort with
    SIGABRT after the work is done). The processes meet first, so none leaves while a peer is still inside the last
    collective. An exception still propagates (the launcher reports its traceback)."""
    import torch.distributed as dist

    from flowgrpo.launch import end_launched_process

    fn(*args)
    if dist.is_initialized():
        dist.barrier()
    end_launched_process()


def run_processes(fn, *args, num_processes: int = 2) -> None:
    """Run ``fn(*args)`` in ``num_processes`` CPU processes joined by a gloo process group (the rendezvous of
    accelerate's ``debug_launcher``), each a fresh interpreter: spawned, not forked. A fork of a process whose
    OpenMP / BLAS thread pools have run can deadlock in the child's first threaded op (both workers of the trainer's
    2-process test hung in ``torch.outer`` while building the model, now and then), and the parent here always has
    run them. ``fn`` must be a module-level function (the children import it by name)."""
    import tempfile

    from accelerate.utils import patch_environment
    from accelerate.utils.launch import PrepareForLaunch
    from torch.multiprocessing import start_processes

    with tempfile.NamedTemporaryFile() as rendezvous, patch_environment(
        world_size=num_processes, master_addr="127.0.0.1", accelerate_mixed_precision="no",
        accelerate_debug_rdv_file=rendezvous.name, accelerate_use_cpu="yes", gloo_socket_ifname="lo",
    ):
        start_processes(PrepareForLaunch(_run_then_leave_the_group, debug=True), args=(fn, *args), nprocs=num_processes, start_method="spawn")
