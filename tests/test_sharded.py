"""Sharded training on CPU: FSDP2 over 2 gloo processes, through accelerate with conf/accelerate/fsdp.yaml's
fsdp_config, with gradient clipping and the EMA on. Clipping and the EMA act on the sharded parameters (the
clipped gradient norm is the 1-process run's, the EMA moves); a checkpoint gathers the full trainable weights,
optimizer state and EMA, a resume shards them again and equals running on, and the diffusers LoRA it writes is the
full one. Plus fast checks of the start-up guards (DeepSpeed, FSDP1) and of the state helpers
without a process group.

accelerate only selects FSDP for GPU-like devices: ``Accelerator(cpu=True, fsdp_plugin=...)`` silently falls back
to MULTI_CPU (DDP) and ignores the plugin. The test sets the distributed type to FSDP after constructing the
Accelerator; from there on everything is accelerate's and torch's own FSDP2 path (``accelerator.prepare`` calls
``fully_shard`` on a gloo device mesh; the parameters become DTensors sharded across the two ranks).
What it does not cover: CUDA/NCCL, bf16 mixed precision (the preset's; fp32 here so that resume can be compared
bit for bit), FSDP1, DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from test_trainer import ALGOS, make_cfg
from twins import run_processes  # tests/twins.py

ROOT = Path(__file__).resolve().parents[1]
# Clipping below the gradient norm (~1e-3 here), so that every update is clipped; an EMA that moves visibly per update.
MAX_GRAD_NORM, EMA_DECAY = 1e-4, 0.5
_WINDOW = next(o for o in ALGOS["mix_grpo"] if ".window.size=" in o).split(".window.")[0]  # the window's config group
OVERRIDES = [*ALGOS["mix_grpo"], "trainer.iterations=2", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=5",
             f"{_WINDOW}.window.shift_interval=1", f"trainer.max_grad_norm={MAX_GRAD_NORM}",
             "trainer.ema.enabled=true", f"trainer.ema.decay={EMA_DECAY}"]


def fsdp_plugin_from_preset():
    """accelerate's FSDP plugin with the fsdp_config of conf/accelerate/fsdp.yaml (what ``accelerate launch`` turns
    into FSDP_* environment variables, passed as arguments instead)."""
    from accelerate import FullyShardedDataParallelPlugin

    cfg = yaml.safe_load((ROOT / "conf/accelerate/fsdp.yaml").read_text())["fsdp_config"]
    rename = {"version": "fsdp_version", "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
              "offload_params": "cpu_offload"}
    kwargs = {rename.get(k[len("fsdp_"):], k[len("fsdp_"):]): v for k, v in cfg.items()}
    kwargs["auto_wrap_policy"] = kwargs["auto_wrap_policy"].lower()
    return FullyShardedDataParallelPlugin(**kwargs)


def _fsdp_worker(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.tensor import DTensor

    from flowgrpo.trainer import Trainer

    torch.set_num_threads(1)
    plugin = fsdp_plugin_from_preset()
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    assert acc.distributed_type == DistributedType.MULTI_CPU  # accelerate's CPU fallback (see the module docstring)
    # what AcceleratorState.__init__ does for FSDP on GPUs (both states: a later AcceleratorState() copies
    # PartialState's distributed type back)
    PartialState._shared_state["distributed_type"] = acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    assert acc.is_fsdp2

    straight = Trainer(make_cfg(tmp_path / "a", *OVERRIDES), tmp_path / "a", accelerator=acc)
    lora = [p for n, p in straight.unwrapped.named_parameters() if p.requires_grad]
    assert all(isinstance(p, DTensor) for p in lora)
    assert sum(p.to_local().numel() for p in lora) < sum(p.numel() for p in lora)  # really sharded
    # Clipping and the EMA use the live sharded parameters (the start-up guard in maybe_resume has nothing to refuse;
    # fit() calls it), and the EMA's shadow is sharded as they are.
    assert len(straight.params) == len(lora) and all(p is q for p, q in zip(straight.params, lora))
    assert straight.ema.params is straight.params
    for s, p in zip(straight.ema.shadow, lora):
        assert isinstance(s, DTensor) and s.placements == p.placements and s.to_local().shape == p.to_local().shape
    straight.fit()  # checkpoints after iterations 1 and 2
    resume = f"trainer.resume={tmp_path / 'a/checkpoints/checkpoint-000001'}"
    resumed = Trainer(make_cfg(tmp_path / "b", *OVERRIDES, resume), tmp_path / "b", accelerator=acc)
    resumed.fit()  # loads iteration 1 on every rank (the EMA sharded again), runs iteration 2, checkpoints
    assert resumed.iteration == 2 and acc.is_fsdp2
    live = [p for p in resumed.unwrapped.parameters() if p.requires_grad]
    assert all(p is q for p, q in zip(resumed.ema.params, live))
    for s, p in zip(resumed.ema.shadow, live):
        assert isinstance(s, DTensor) and s.placements == p.placements


def _load(path: Path) -> dict:
    return torch.load(path / "state.pt", weights_only=True)


def _lora(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "lora" / "pytorch_lora_weights.safetensors")


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_exactly_and_saves_the_full_lora(tmp_path):
    from flowgrpo.trainer import Trainer

    run_processes(_fsdp_worker, tmp_path)
    a1, a2 = tmp_path / "a/checkpoints/checkpoint-000001", tmp_path / "a/checkpoints/checkpoint-000002"
    b2 = tmp_path / "b/checkpoints/checkpoint-000002"
    straight, resumed = _load(a2), _load(b2)

    # Resume = running on, bit for bit: the same weights, Adam moments, EMA and window after iteration 2.
    assert straight["trainable"].keys() == resumed["trainable"].keys()
    for n, v in straight["trainable"].items():
        assert torch.equal(v, resumed["trainable"][n]), n
    for n, s in straight["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, resumed["optimizer"]["state"][n][k]), (n, k)
    assert straight["ema"]["decay"] == resumed["ema"]["decay"] == EMA_DECAY
    assert len(straight["ema"]["shadow"]) == len(resumed["ema"]["shadow"]) == len(straight["trainable"])
    assert all(torch.equal(s, r) for s, r in zip(straight["ema"]["shadow"], resumed["ema"]["shadow"]))
    assert straight["algorithm"] == resumed["algorithm"]
    measured = [{k: v for k, v in row.items() if not k.startswith("time/")} for row in straight["history"]]
    assert measured == [{k: v for k, v in row.items() if not k.startswith("time/")} for row in resumed["history"]]

    # The checkpoint is complete (full shapes, every trainable parameter, its Adam state and its EMA), and the LoRA
    # file holds those full tensors.
    one = Trainer(make_cfg(tmp_path / "one", *OVERRIDES, "trainer.iterations=1"), tmp_path / "one")
    names = [n for n, p in one.unwrapped.named_parameters() if p.requires_grad]
    full = {n: p.shape for n, p in one.unwrapped.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in one.unwrapped.named_parameters() if p.requires_grad}
    assert {n: v.shape for n, v in straight["trainable"].items()} == full
    assert set(straight["optimizer"]["state"]) == set(full)
    assert all(s["exp_avg"].shape == full[n] for n, s in straight["optimizer"]["state"].items())
    assert [s.shape for s in straight["ema"]["shadow"]] == [full[n] for n in names]
    for ckpt in (a1, a2, b2):
        state, lora = _load(ckpt), _lora(ckpt)
        assert len(lora) == len(full)
        for n, v in state["trainable"].items():
            assert torch.equal(lora["transformer." + n.replace(".default.", ".")], v), n

    # Clipping saw the gradients of the sharded parameters (with the parameters from before prepare it would see
    # none: norm 0) and clipped every update; the EMA followed the weights: one update per iteration, so after
    # iteration 1 it is lerp(start, weights, 1 - decay), elementwise and so exactly, sharded or not.
    first = _load(a1)
    assert first["updates"] == 1
    norms = [row["train/grad_norm"] for row in straight["history"]]
    assert len(norms) == 2 and all(g > 5 * MAX_GRAD_NORM for g in norms), norms
    for n, s in zip(names, first["ema"]["shadow"]):
        assert torch.equal(s, torch.lerp(start[n], first["trainable"][n], 1 - EMA_DECAY)), n
    ema_moved = max(float((s - start[n]).abs().max()) for n, s in zip(names, first["ema"]["shadow"]))
    assert ema_moved > 1e-3, ema_moved

    # ...and it is what one unsharded process trains: the first iteration's gradient norm, LoRA and EMA against a
    # 1-process run (same global batch; the split changes only float summation order, magnified in the weights by
    # Adam's 1/sqrt(v) as in tests/test_trainer.py's 2-process test).
    one.fit()
    one_norm = one.history[0]["train/grad_norm"]
    assert norms[0] == pytest.approx(one_norm, rel=1e-5), (norms[0], one_norm)
    ref = _lora(tmp_path / "one/checkpoints/checkpoint-000001")
    sharded = _lora(a1)
    assert ref.keys() == sharded.keys() and all(ref[k].shape == sharded[k].shape for k in ref)
    key = {n: "transformer." + n.replace(".default.", ".") for n in names}
    moved = max(float((ref[key[n]] - start[n]).abs().max()) for n in names)
    diff = max(float((ref[k] - sharded[k]).abs().max()) for k in ref)
    assert moved > 1e-2
    assert diff < 1e-2 * moved, (diff, moved)
    one_ema = _load(tmp_path / "one/checkpoints/checkpoint-000001")["ema"]["shadow"]
    ema_diff = max(float((o - s).abs().max()) for o, s in zip(one_ema, first["ema"]["shadow"]))
    assert ema_diff < 1e-2 * ema_moved, (ema_diff, ema_moved)
    print(f"\nFSDP grad norms {norms} (max_grad_norm {MAX_GRAD_NORM}), 1 process {one_norm}; "
          f"LoRA moved {moved:.3g}, 2-vs-1 {diff:.3g}; EMA moved {ema_moved:.3g}, 2-vs-1 {ema_diff:.3g}")


# ------------------------------------------------------------------------------------- fast: no processes


class _FakeAccelerator:
    def __init__(self, kind, fsdp2=True):
        from accelerate.utils import DistributedType

        self.distributed_type = DistributedType(kind)
        self.is_fsdp2 = fsdp2 and kind == "FSDP"
        self.is_main_process = True

    def wait_for_everyone(self):
        pass


def test_gathers_state_by_distributed_type():
    from flowgrpo.finetune import gathers_state

    assert not gathers_state(_FakeAccelerator("NO")) and not gathers_state(_FakeAccelerator("MULTI_GPU"))
    assert gathers_state(_FakeAccelerator("FSDP"))
    with pytest.raises(NotImplementedError, match="deepspeed_zero2.yaml"):
        gathers_state(_FakeAccelerator("DEEPSPEED"))
    with pytest.raises(NotImplementedError, match="FSDP1"):
        gathers_state(_FakeAccelerator("FSDP", fsdp2=False))


def _bare_trainer(tmp_path, kind, **trainer_cfg):
    """A Trainer shell with just what maybe_resume / save_checkpoint read before they gather or write."""
    from omegaconf import OmegaConf

    from flowgrpo.checkpoint import CheckpointManager
    from flowgrpo.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.acc = _FakeAccelerator(kind)
    trainer.cfg = OmegaConf.create({"trainer": {"resume": None, "max_grad_norm": None, **trainer_cfg},
                                    "model": {"finetune": "lora"}})
    trainer.unwrapped = torch.nn.Linear(2, 2)
    trainer.params = list(trainer.unwrapped.parameters())
    trainer.ema = None
    trainer.ckpt = CheckpointManager(tmp_path / "checkpoints")
    return trainer


def test_deepspeed_fails_at_start_up_and_writes_no_checkpoint(tmp_path):
    trainer = _bare_trainer(tmp_path, "DEEPSPEED")
    with pytest.raises(NotImplementedError, match="DeepSpeed"):
        trainer.maybe_resume()
    with pytest.raises(NotImplementedError, match="DeepSpeed"):
        trainer.save_checkpoint()
    assert trainer.ckpt.latest() is None


def test_fsdp_start_up_allows_clipping_and_ema(tmp_path):
    """Trainer.__init__ re-reads its parameters after accelerate.prepare and builds the EMA on them, so under FSDP
    clipping and the EMA start up on the module's own parameters (the slow test checks that on really sharded ones)."""
    from flowgrpo.finetune import EMA

    trainer = _bare_trainer(tmp_path, "FSDP", max_grad_norm=MAX_GRAD_NORM)
    trainer.ema = EMA(trainer.params, EMA_DECAY)
    assert trainer.maybe_resume() is False


def test_optimizer_state_keyed_by_name_loads_into_a_plain_optimizer():
    """A checkpoint written under FSDP (torch.distributed.checkpoint's name-keyed optimizer state) resumes in a
    single process, and a plain checkpoint's integer-keyed state converts to names the other way."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from flowgrpo.finetune import _rekey_optimizer_state, load_optimizer_state

    def model_and_optimizer(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        model[0].weight.requires_grad_(False)  # frozen weight between trainable ones, as with LoRA
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        return model, opt

    model, opt = model_and_optimizer(0)
    by_name = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert set(by_name["state"]) == {"0.bias", "1.weight", "1.bias"}
    fresh_model, fresh = model_and_optimizer(1)
    load_optimizer_state(fresh_model, fresh, by_name)
    expected, got = opt.state_dict(), fresh.state_dict()
    assert expected["param_groups"] == got["param_groups"]
    for i, s in expected["state"].items():
        assert all(torch.equal(v, got["state"][i][k]) for k, v in s.items())
    names = ["0.bias", "1.weight", "1.bias"]
    assert set(_rekey_optimizer_state(opt.state_dict(), names)["state"]) == set(names)


def test_lora_and_transformer_writers_take_gathered_tensors(tmp_path):
    """The writers of save_checkpoint under FSDP: the LoRA and the full transformer from given full tensors."""
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    from flowgrpo.checkpoint import save_lora_weights, save_transformer_weights
    from flowgrpo.finetune import trainable_state
    from flowgrpo.models import build_tiny_pipeline

    pipe = build_tiny_pipeline("sd3")
    transformer = pipe.transformer
    full = {n: torch.randn_like(p) for n, p in transformer.named_parameters()}
    save_transformer_weights(transformer, tmp_path / "transformer", full)
    loaded = SD3Transformer2DModel.from_pretrained(tmp_path / "transformer")
    assert all(torch.equal(p, full[n]) for n, p in loaded.named_parameters())
    assert all(torch.equal(b, dict(transformer.named_buffers())[n]) for n, b in loaded.named_buffers())
    with pytest.raises(ValueError, match="no tensor for"):
        save_transformer_weights(transformer, tmp_path / "partial", dict(list(full.items())[1:]))

    from peft import LoraConfig

    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]))
    lora = {n: torch.randn_like(v) for n, v in trainable_state(transformer).items()}
    save_lora_weights(pipe, tmp_path / "lora", state_dict=lora)
    saved = load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    assert saved.keys() == {"transformer." + n.replace(".default.", ".") for n in lora}
    assert all(torch.equal(saved["transformer." + n.replace(".default.", ".")], v) for n, v in lora.items())


class _ShardedAccelerator(_FakeAccelerator):
    """FSDP2 as the update guard sees it: a sum over the gloo group."""

    def __init__(self):
        super().__init__("FSDP")

    def reduce(self, tensor, reduction="sum"):
        import torch.distributed as dist

        assert reduction == "sum"
        dist.all_reduce(tensor)
        return tensor


def _rollback_worker(out):
    """Weights sharded over 2 processes (DTensors, Shard(0)) and AdamW: an ordinary step stays; a step at lr 1e6 is
    measured on the whole weights (every process the same ratio) and undone on every shard, moments included."""
    import json
    from types import SimpleNamespace

    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from flowgrpo.guards import Guards

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    full = torch.randn(6, 4)
    param = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    run = SimpleNamespace(cfg=OmegaConf.create({"trainer": {"max_update_ratio": 1.0}, "model": {"finetune": "full"}}),
                          params=[param], optimizer=optimizer, device=torch.device("cpu"), acc=_ShardedAccelerator(),
                          _update_guard=None)

    def step(grad_scale):
        param.grad = distribute_tensor(torch.full_like(full, grad_scale), mesh, [Shard(0)])
        before = Guards._pre_step_copy(run)
        whole_before = param.full_tensor().clone()
        optimizer.step()
        moved = float((param.full_tensor() - whole_before).norm() / whole_before.norm())
        return Guards._undo_if_diverged(run, before), moved

    kept, small = step(1.0)
    assert kept is None and 0 < small < 1.0
    shard = param.to_local().clone()
    moments = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in optimizer.state[param].items()}
    optimizer.param_groups[0]["lr"] = 1e6
    ratio, big = step(1.0)
    assert ratio == pytest.approx(big, rel=1e-6) and ratio > 1.0  # the whole weights' ratio, on both processes
    assert torch.equal(param.to_local(), shard)
    for k, v in optimizer.state[param].items():
        assert torch.equal((v.to_local() if isinstance(v, DTensor) else v), moments[k]), k
    ratios = [None, None]
    dist.all_gather_object(ratios, ratio)
    if dist.get_rank() == 0:
        (out / "ratios.json").write_text(json.dumps(ratios))


def test_a_diverging_update_of_sharded_weights_is_undone_on_every_shard(tmp_path):
    import json

    run_processes(_rollback_worker, tmp_path)
    first, second = json.loads((tmp_path / "ratios.json").read_text())
    assert first == second > 1.0
