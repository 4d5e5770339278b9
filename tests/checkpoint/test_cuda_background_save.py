"""A background save from a GPU: staged into pinned host memory (needs 1 CUDA GPU; never run
here, see docs/gpu.md)."""

from __future__ import annotations

import threading

import torch
from torch import nn

import distkit
from distkit.checkpoint import _writes
from distkit.runtime._background_save import stage
from tests.support.gates import needs


@needs("cuda")
def test_staging_a_cuda_state_copies_it_to_pinned_host_memory():
    tensor = torch.arange(1000, dtype=torch.float32, device="cuda")
    staged = stage({"w": tensor})["w"]
    torch.cuda.synchronize()
    assert staged.device.type == "cpu" and staged.is_pinned()
    assert torch.equal(staged, tensor.cpu())


@needs("cuda")
def test_a_background_save_on_the_gpu_holds_the_state_of_its_call(tmp_path):
    gate = threading.Event()
    real = _writes.save_new

    def slow(*args, **kwargs):
        assert gate.wait(30)
        return real(*args, **kwargs)

    with distkit.Runtime("dp", fault_timeout=None) as rt:
        torch.manual_seed(0)
        model = rt.setup(nn.Linear(64, 64))
        assert next(model.parameters()).device.type == "cuda"
        before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        _writes.save_new = slow
        try:
            handle = rt.save(tmp_path / "state.pt", {"model": model}, blocking=False)
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(2.0)  # the GPU trains on while the save persists
            gate.set()
            handle.wait()
        finally:
            _writes.save_new = real
    saved = torch.load(tmp_path / "state.pt", weights_only=True)["model"]
    assert all(torch.equal(saved[k], before[k]) for k in before)
