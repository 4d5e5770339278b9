"""``deterministic=``: torch's global switches set while a Runtime is open, put back after,
and two seeded fits give bit-identical weights."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.errors import ConfigurationError
from distkit.runtime._determinism import CUBLAS_SETTING, CUBLAS_VARIABLE
from tests.support.gates import needs

pytestmark = pytest.mark.timeout(120)


def _settings() -> tuple:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get(CUBLAS_VARIABLE),
    )


@pytest.fixture
def clean_settings(monkeypatch):
    """The defaults before, and every global put back after, whatever the test did."""
    before = _settings()
    monkeypatch.delenv(CUBLAS_VARIABLE, raising=False)
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2:4]


@pytest.mark.parametrize("mode, warn_only", [(True, False), ("warn", True)])
def test_determinism_is_on_while_the_runtime_is_open_and_restored_after(
    clean_settings, mode, warn_only
):
    torch.backends.cudnn.benchmark = True  # the user's own choice, put back at close
    before = _settings()
    with distkit.Runtime("dp", deterministic=mode) as rt:
        assert rt.options.deterministic == mode
        assert _settings() == (True, warn_only, True, False, CUBLAS_SETTING)
    assert _settings() == before
    rt.close()  # idempotent: restores nothing twice
    assert _settings() == before


def test_determinism_keeps_a_cublas_setting_the_user_made(clean_settings, monkeypatch):
    monkeypatch.setenv(CUBLAS_VARIABLE, ":16:8")
    rt = distkit.Runtime("dp", deterministic=True)
    assert os.environ[CUBLAS_VARIABLE] == ":16:8"
    rt.close()
    assert os.environ[CUBLAS_VARIABLE] == ":16:8"


def test_determinism_warns_when_cuda_was_initialised_before(clean_settings, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(RuntimeWarning, match="CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment"):
        rt = distkit.Runtime("dp", deterministic=True)
    rt.close()


def test_determinism_off_by_default_changes_nothing(clean_settings):
    before = _settings()
    with distkit.Runtime("dp") as rt:
        assert rt.options.deterministic is False
        assert _settings() == before


@pytest.mark.parametrize("value", [1, "yes", None, "True"])
def test_determinism_refuses_other_values(clean_settings, value):
    before = _settings()
    with pytest.raises(ConfigurationError, match="deterministic must be False, True or 'warn'"):
        distkit.Runtime("dp", deterministic=value)
    with pytest.raises(ConfigurationError, match="deterministic must be False, True or 'warn'"):
        distkit.Trainer("dp", deterministic=value)
    assert _settings() == before


def test_determinism_refuses_cudnn_benchmark(clean_settings):
    with pytest.raises(ConfigurationError, match="cudnn_benchmark=True with deterministic=True"):
        distkit.Trainer("dp", deterministic=True, cudnn_benchmark=True)
    with (
        distkit.Runtime("dp", deterministic="warn") as rt,
        pytest.raises(ConfigurationError, match="deterministic='warn'"),
    ):
        distkit.Trainer(runtime=rt, cudnn_benchmark=True)


def test_determinism_of_a_given_runtime_must_agree(clean_settings):
    with (
        distkit.Runtime("dp") as rt,
        pytest.raises(ConfigurationError, match="created with deterministic=False"),
    ):
        distkit.Trainer(runtime=rt, deterministic=True)
    with distkit.Runtime("dp", deterministic=True) as rt:
        trainer = distkit.Trainer(runtime=rt, deterministic=True)
        assert trainer.config.deterministic is True
        assert distkit.Trainer(runtime=rt).config.deterministic is True  # the runtime's
        trainer.close()
        assert torch.are_deterministic_algorithms_enabled(), "the runtime is still open"
    assert not torch.are_deterministic_algorithms_enabled()


def _fit_weights() -> list[dict[str, torch.Tensor]]:
    """Two seeded fits (dropout and shuffling included), deterministic=True."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        data = TensorDataset(x, x.sum(1, keepdim=True))
        with distkit.Trainer(
            "ddp", batch_size=8, max_epochs=2, progress=False, deterministic=True
        ) as trainer:
            assert torch.are_deterministic_algorithms_enabled()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            trainer.fit(model, optimizer, data, loss_fn=nn.functional.mse_loss)
        assert not torch.are_deterministic_algorithms_enabled(), "restored at close"
        runs.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return runs


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world_size", [1, 2])
def test_determinism_two_fits_give_bit_identical_weights(run_on_ranks, world_size):
    per_rank = run_on_ranks(_fit_weights, world_size=world_size)
    for first, second in per_rank:
        assert _bitwise_equal(first, second)
    assert all(_bitwise_equal(per_rank[0][0], runs[0]) for runs in per_rank)


@needs("cuda")
def test_determinism_on_cuda_refuses_or_warns_about_atomic_adds(clean_settings):
    index = torch.tensor([0, 0, 1], device="cuda")
    source = torch.ones(3, 4, device="cuda")
    with distkit.Runtime("dp", deterministic=True):
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        with pytest.raises(RuntimeError, match="deterministic"):
            torch.zeros(2, 4, device="cuda").index_add_(0, index, source)
    with (
        distkit.Runtime("dp", deterministic="warn"),
        pytest.warns(UserWarning, match="deterministic"),
    ):
        torch.zeros(2, 4, device="cuda").index_add_(0, index, source)
