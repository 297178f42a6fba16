"""KL controllers (trlX semantics) and the KL estimators, hand-computed."""
import math
import pickle

import pytest
import torch

from algorithms.core.kl_control import AdaptiveKLController, FixedKLController, KLStateError, build_kl_controller
from algorithms.core.kl_estimators import kl_metrics, kl_terms, token_kl

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


def test_kl_metrics_per_token_k1_and_k3_on_the_mask():
    mask = torch.tensor([[0., 1., 1., 1., 0.], [0., 0., 1., 1., 1.]])
    logp = torch.tensor([[5.0, -1.0, -2.0, -0.5, 5.0], [5.0, 5.0, -1.0, -2.0, -3.0]])
    ref = torch.tensor([[0.0, -1.5, -1.0, -0.5, 0.0], [0.0, 0.0, -1.2, -2.0, -2.5]])
    # d = ref - logp on the mask: row 0 (-0.5, 1.0, 0.0), row 1 (-0.2, 0.0, 0.5)
    d = [-0.5, 1.0, 0.0, -0.2, 0.0, 0.5]
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    got = kl_metrics(logp, ref, mask)
    assert got["kl"] == pytest.approx(-sum(d) / 6, abs=1e-6)
    assert got["kl_k3"] == pytest.approx(sum(map(k3, d)) / 6, abs=1e-6)
    assert got["kl_sequence"] == pytest.approx(((0.5 - 1.0) + (0.2 - 0.5)) / 2, abs=1e-6)
    assert token_kl(logp, ref, mask, "k2") == pytest.approx(sum(x * x / 2 for x in d) / 6, abs=1e-6)


def test_k3_stays_bounded_where_trlx_form_explodes():
    """A policy that became nearly deterministic: log p = 0 where the reference gave -8. The
    unbiased k3 is about 7 per token; trlX's form, exp(8) - 1 - 8, is about 2,972."""
    logp, ref, mask = torch.zeros(1, 4), torch.full((1, 4), -8.0), torch.ones(1, 4)
    assert token_kl(logp, ref, mask, "k3") == pytest.approx(math.exp(-8) + 8 - 1, rel=1e-6)
    assert token_kl(logp, ref, mask, "k1") == pytest.approx(8.0)
    assert float(kl_terms(logp, ref, "k3")[0, 0]) < 8.0
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_terms(logp, ref, "k4")
