"""When the kernels launch with programmatic dependent launch (kernels/pdl.py): only on CUDA
devices that support it, per the config table or LUCEIO_PDL, never under the interpreter; the
early launch signal only from small grids. (That PDL leaves every output unchanged is
tests/gpu/test_quant_engine_gpu.py's PDL test.)"""
import dataclasses

import pytest
import torch

from luceio.kernels import configs, pdl

CUDA = torch.device("cuda", 0)


@pytest.fixture
def capable(monkeypatch):
    """A CUDA device that supports PDL, outside the interpreter, no LUCEIO_PDL."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_ENV", None)
    monkeypatch.setattr(pdl, "_capable", lambda device: True)
    monkeypatch.setattr(pdl, "_DECIDED", {})


def test_table_turns_pdl_on_for_hopper_only():
    assert configs.TABLE["sm_90"].pdl
    assert not any(cfg.pdl for arch, cfg in configs.TABLE.items() if arch != "sm_90")


def test_small_grids_signal_early_large_ones_do_not(capable):
    cfg = configs.TABLE["sm_90"]
    small = pdl.pdl_kwargs(CUDA, cfg, 24)
    assert small == {"PDL": True, "PDL_EARLY": True, "launch_pdl": True}
    limit = cfg.pdl_early_max_programs
    assert pdl.pdl_kwargs(CUDA, cfg, limit)["PDL_EARLY"]
    assert pdl.pdl_kwargs(CUDA, cfg, limit + 1) == {"PDL": True, "PDL_EARLY": False,
                                                      "launch_pdl": True}


def test_off_where_the_config_or_the_device_says_so(capable, monkeypatch):
    on = configs.TABLE["sm_90"]
    assert pdl.pdl_kwargs(CUDA, dataclasses.replace(on, pdl=False), 8) == {}
    assert pdl.pdl_kwargs(torch.device("cpu"), on, 8) == {}
    monkeypatch.setattr(pdl, "_capable", lambda device: False)  # pre-Hopper, or ROCm
    assert pdl.pdl_kwargs(torch.device("cuda", 1), on, 8) == {}


def test_never_under_the_interpreter(capable, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_kwargs(CUDA, configs.TABLE["sm_90"], 8) == {}


@pytest.mark.parametrize("env, cfg_on, expect", [("0", True, False), ("1", False, True),
                                                 ("false", True, False)])
def test_environment_overrides_the_table(capable, monkeypatch, env, cfg_on, expect):
    monkeypatch.setattr(pdl, "_ENV", env)
    cfg = dataclasses.replace(configs.TABLE["sm_90"], pdl=cfg_on)
    assert bool(pdl.pdl_kwargs(CUDA, cfg, 8)) == expect


def test_decision_follows_a_new_config_object(capable):
    on = configs.TABLE["sm_90"]
    assert pdl.pdl_kwargs(CUDA, on, 8)
    off = dataclasses.replace(on, pdl=False)
    assert pdl.pdl_kwargs(CUDA, off, 8) == {}
    assert pdl.pdl_kwargs(CUDA, on, 8)
