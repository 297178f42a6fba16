"""KL controllers (trlX semantics) and the per-sequence KL measurement, hand-computed."""
import math
import pickle

import pytest
import torch

from algorithms.ppo.kl import (AdaptiveKLController, FixedKLController, KLStateError, build_kl_controller,
                               sequence_kl)

pytestmark = pytest.mark.unit


def test_adaptive_controller_clips_error_and_scales_by_horizon():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=256)      # error 0.5 clipped to 0.2: x (1 + 0.2 * 0.0256)
    assert ctl.value == pytest.approx(0.100512, rel=1e-12)
    ctl.update(5.4, n_steps=256)      # error -0.1: x (1 - 0.1 * 0.0256)
    assert ctl.value == pytest.approx(0.100512 * 0.99744, rel=1e-12)
    ctl.update(0.0, n_steps=10000)    # error -1 clipped to -0.2: x 0.8
    assert ctl.value == pytest.approx(0.100512 * 0.99744 * 0.8, rel=1e-12)


def test_fixed_controller_never_moves():
    ctl = build_kl_controller(0.05, None, 10000)
    assert isinstance(ctl, FixedKLController)
    ctl.update(100.0, 256)
    assert ctl.value == 0.05


def test_state_dict_resumes_exactly():
    a = build_kl_controller(0.2, 3.0, 500)
    for kl in (4.0, 1.0, 3.5):
        a.update(kl, 16)
    b = AdaptiveKLController(0.2, 3.0, 500)
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    a.update(2.0, 16)
    b.update(2.0, 16)
    assert a.value == b.value and a.value != 0.2
    with pytest.raises(KLStateError, match="same ppo.kl_target"):
        FixedKLController(0.1).load_state_dict(a.state_dict())
    with pytest.raises(KLStateError, match="kl_horizon"):
        AdaptiveKLController(0.2, 3.0, 100).load_state_dict(a.state_dict())


def test_bad_adaptive_settings_rejected():
    with pytest.raises(ValueError, match="kl_target to null"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_sequence_kl_k3_sum_per_row_mean():
    mask = torch.tensor([[0., 1., 1., 1., 0.], [0., 0., 1., 1., 1.]])
    logp = torch.tensor([[5.0, -1.0, -2.0, -0.5, 5.0], [5.0, 5.0, -1.0, -2.0, -3.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, -0.5, 0.0], [0.0, 0.0, -1.2, -2.0, -2.5]])
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731
    expected = ((k3(0.5) + k3(-1.0)) + (k3(0.2) + k3(-0.5))) / 2
    assert sequence_kl(logp, ref, mask) == pytest.approx(expected, abs=1e-6)
