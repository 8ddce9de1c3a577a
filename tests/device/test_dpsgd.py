"""DP-SGD on the device (DESIGN §5): the numpy last-layer trainer checked against its definition and against
torch autograd (torch runs in the test only; the device has numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud.incremental import accounting, surgery
from device.training.dpsgd import GaussianNoise, HeadTrainer, clip_per_example, gradient_norms, noisy_gradient, per_example_gradients, residuals
from device.training.features import body_features
from tests.dp_support import accuracy, cloud_model, digits


def problem(n: int = 64, d: int = 20, c: int = 7, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((n, d)).astype(np.float32) * rng.uniform(0.05, 20, size=(n, 1)).astype(np.float32)  # norms from tiny to huge
    weight = (rng.standard_normal((d, c)) * 0.3).astype(np.float32)
    bias = (rng.standard_normal(c) * 0.1).astype(np.float32)
    labels = rng.integers(0, c, size=n)
    return weight, bias, features, labels


def test_every_examples_gradient_is_clipped_to_the_bound() -> None:
    weight, bias, features, labels = problem()
    clip = 0.5
    dw, db = per_example_gradients(weight, bias, features, labels)
    norms = np.sqrt(np.einsum("nij,nij->n", dw.astype(np.float64), dw) + np.einsum("nj,nj->n", db.astype(np.float64), db))
    e, _ = residuals(weight, bias, features, labels)
    np.testing.assert_allclose(gradient_norms(features, e), norms, rtol=1e-5)  # the closed form is the norm over (W, b)
    assert (norms > clip).sum() >= 10 and (norms < clip).sum() >= 5  # some examples are clipped, some are not
    cw, cb = clip_per_example(dw, db, clip)
    clipped = np.sqrt(np.einsum("nij,nij->n", cw.astype(np.float64), cw) + np.einsum("nj,nj->n", cb.astype(np.float64), cb))
    assert (clipped <= clip + 1e-6).all(), clipped.max()
    small = norms < clip
    np.testing.assert_allclose(clipped[small], norms[small], rtol=1e-6)  # untouched below the bound
    # the trainer's one-product form is the sum of those clipped gradients (no noise, divided by 1)
    gw, gb, fraction = noisy_gradient(weight, bias, features, labels, clip_norm=clip, noise_multiplier=0, expected_batch=1, rng=np.random.default_rng())
    np.testing.assert_allclose(gw, cw.sum(axis=0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gb, cb.sum(axis=0), rtol=1e-4, atol=1e-5)
    assert fraction == pytest.approx((norms > clip).mean())


def _torch_gradient(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(torch.tensor(features, dtype=torch.float64) @ w + b, torch.tensor(labels))
    loss.backward()
    assert w.grad is not None and b.grad is not None
    return w.grad.numpy(), b.grad.numpy()


def test_without_noise_or_clipping_it_is_plain_sgd() -> None:
    weight, bias, features, labels = problem(n=50, d=12, c=5, seed=3)
    gw, gb, _ = noisy_gradient(weight, bias, features, labels, clip_norm=np.inf, noise_multiplier=0, expected_batch=len(labels), rng=np.random.default_rng())
    ref_w, ref_b = _torch_gradient(weight, bias, features, labels)
    np.testing.assert_allclose(gw, ref_w, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gb, ref_b, rtol=1e-4, atol=1e-6)
    # sample rate 1 takes every example: steps of the trainer are torch.optim.SGD's steps
    trainer = HeadTrainer(weight, bias, features, labels, learning_rate=0.05, clip_norm=np.inf, noise_multiplier=0, sample_rate=1.0, seed=1)
    w = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    sgd = torch.optim.SGD([w, b], lr=0.05)
    for _ in range(5):
        stats = trainer.step()
        sgd.zero_grad()
        loss = torch.nn.functional.cross_entropy(torch.tensor(features, dtype=torch.float64) @ w + b, torch.tensor(labels))
        loss.backward()
        sgd.step()
        assert stats.batch == len(labels) and stats.loss == pytest.approx(loss.item(), rel=1e-4)
    np.testing.assert_allclose(trainer.weight, w.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(trainer.bias, b.detach().numpy(), rtol=1e-4, atol=1e-5)


def test_noise_has_standard_deviation_sigma_times_c() -> None:
    weight, bias, features, labels = problem(n=32, d=100, c=50, seed=5)
    sigma, clip, expected = 1.3, 0.7, 16.0
    rng = np.random.default_rng(11)
    kw = {"clip_norm": clip, "expected_batch": expected}
    clean_w, clean_b, _ = noisy_gradient(weight, bias, features, labels, noise_multiplier=0, rng=rng, **kw)
    noise_w, noise_b = [], []
    for _ in range(20):  # 20 x 5,050 coordinates
        gw, gb, _ = noisy_gradient(weight, bias, features, labels, noise_multiplier=sigma, rng=rng, **kw)
        noise_w.append((gw - clean_w) * expected)
        noise_b.append((gb - clean_b) * expected)
    samples = np.concatenate([np.ravel(noise_w), np.ravel(noise_b)]).astype(np.float64)
    assert samples.std() == pytest.approx(sigma * clip, rel=0.02)  # 101,000 samples: the std's standard error is 0.2 %
    assert abs(samples.mean()) < 0.02 * sigma * clip
    # an empty Poisson batch is noise alone
    gw, _, _ = noisy_gradient(weight, bias, features[:0], labels[:0], noise_multiplier=sigma, rng=rng, **kw)
    assert (gw * expected).std() == pytest.approx(sigma * clip, rel=0.05)


def test_noise_drawn_ahead_on_a_thread_is_fresh_every_step() -> None:
    """A large layer's noise is drawn one step ahead on a thread: each draw N(0, std²), none used twice."""
    noise = GaussianNoise((200, 100), 0.9, np.random.Generator(np.random.SFC64(4)), ahead=True)
    draws = []
    try:
        for _ in range(10):
            grad = np.zeros((200, 100), np.float32)
            noise.add_to(grad)
            draws.append(grad)
    finally:
        noise.close()
    assert np.stack(draws).astype(np.float64).std() == pytest.approx(0.9, rel=0.01)
    for a, b in zip(draws, draws[1:], strict=False):  # a reused buffer would correlate perfectly
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.03
    big = problem(n=100, d=300, c=60)
    with HeadTrainer(*big, learning_rate=0.1, clip_norm=1, noise_multiplier=1, sample_rate=0.5, seed=1) as trainer:
        trainer.step()
        assert trainer.noise._thread is not None and trainer.noise._thread.is_alive()
        thread = trainer.noise._thread
    assert not thread.is_alive()  # closed with the trainer


def test_poisson_sampling_draws_each_example_at_the_sample_rate() -> None:
    weight, bias, features, labels = problem(n=1000, d=4, c=3)
    trainer = HeadTrainer(weight, bias, features, labels, learning_rate=0.1, clip_norm=1, noise_multiplier=1, sample_rate=0.05, seed=2)
    sizes = [len(trainer.sample()) for _ in range(400)]
    assert np.mean(sizes) == pytest.approx(50, rel=0.05) and np.std(sizes) > 3  # the batch size varies (binomial)


def test_accuracy_rises_on_the_devices_own_data(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The cloud model scores ~14 % on the device's shifted images; DP-SGD on its last layer, on the device's
    own 700 images (ε ≈ 7 at δ = 1e-5), lifts both them and 197 held-out images of the same device."""
    d = digits()
    model = surgery.load(cloud_model())
    layer = surgery.find_dense(model)
    weight, bias = surgery.layer_arrays(model, layer)
    (tmp_path / "body.onnx").write_bytes(surgery.body(model, layer).SerializeToString())
    features = body_features(tmp_path / "body.onnx", d.x_device, layer.feature)
    train, held_out = slice(0, 700), slice(700, None)
    q, sigma, steps = 64 / 700, 1.0, 100
    trainer = HeadTrainer(weight, bias, features[train], d.y_device[train], learning_rate=0.5, clip_norm=1.0, noise_multiplier=sigma, sample_rate=q, seed=7)
    before = trainer.accuracy()
    assert before == pytest.approx(accuracy(cloud_model(), d.x_device[train], d.y_device[train]), abs=1e-6)  # body + layer = the model
    for _ in range(steps):
        trainer.step()
    after = trainer.accuracy()
    held_before = float(np.mean((features[held_out] @ weight + bias).argmax(1) == d.y_device[held_out]))
    held_after = float(np.mean((features[held_out] @ trainer.weight + trainer.bias).argmax(1) == d.y_device[held_out]))
    epsilon = accounting.run_epsilon(accounting.Run(q, sigma, steps), 1e-5)
    assert before < 0.3 and after > before + 0.3, (before, after)
    assert held_after > held_before + 0.3, (held_before, held_after)
    assert 5 < epsilon < 10
