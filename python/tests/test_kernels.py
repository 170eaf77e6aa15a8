"""strata._strata.Kernels with numpy: each rule against a float64 reference,
bf16 through uint16 views, the fused 16-bit copy, and the errors."""

import numpy as np
import pytest

from strata._strata import Kernels


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_rne(x):
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def adam_reference(p, m, v, g, step, lr, b1, b2, eps, wd, adamw, bias_correction=True):
    if adamw:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1 = 1 - b1**step if bias_correction else 1.0
    bc2 = 1 - b2**step if bias_correction else 1.0
    p = p - lr / bc1 * m / (np.sqrt(v) / np.sqrt(bc2) + eps)
    return p, m, v


@pytest.fixture(scope="module")
def kernels():
    return Kernels(threads=2)


@pytest.mark.parametrize("adamw,wd,bias_correction", [(True, 0.01, True), (False, 0.1, True), (True, 0.0, False)])
def test_adam_tracks_the_f64_reference_for_100_steps(kernels, adamw, wd, bias_correction):
    rng = np.random.default_rng(1)
    n = 100_003  # odd: the vector loop's tail is exercised
    p = rng.standard_normal(n).astype(np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    p64, m64, v64 = p.astype(np.float64), np.zeros(n), np.zeros(n)
    for step in range(1, 101):
        g = rng.standard_normal(n).astype(np.float32)
        kernels.adam(p, g, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=wd, adamw_mode=adamw, bias_correction=bias_correction)
        p64, m64, v64 = adam_reference(p64, m64, v64, g.astype(np.float64), step, 1e-3, 0.9, 0.999,
                                       1e-8, wd, adamw, bias_correction)
    np.testing.assert_allclose(p, p64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, v64, rtol=1e-4, atol=1e-9)


def test_bf16_gradients_and_the_fused_copy_through_uint16_views(kernels):
    rng = np.random.default_rng(2)
    n = 4099
    p = rng.standard_normal(n).astype(np.float32)
    g16 = f32_to_bf16_rne(rng.standard_normal(n).astype(np.float32))
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    copy = np.zeros(n, np.uint16)
    expected, _, _ = adam_reference(p.astype(np.float64), 0.0, 0.0, bf16_to_f32(g16).astype(np.float64),
                                    1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True)
    kernels.adam(p, g16, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 adamw_mode=True, bias_correction=True, param_copy=copy)
    np.testing.assert_allclose(p, expected, rtol=1e-6, atol=1e-7)
    assert (copy == f32_to_bf16_rne(p)).all(), "the copy is the updated parameter rounded to nearest even"


def test_adagrad_and_lion_track_their_references(kernels):
    rng = np.random.default_rng(3)
    n = 5001
    p = rng.standard_normal(n).astype(np.float32)
    s = np.zeros(n, np.float32)
    p64, s64 = p.astype(np.float64), np.zeros(n)
    for step in range(1, 21):
        g = rng.standard_normal(n).astype(np.float32)
        kernels.adagrad(p, g, s, step=step, lr=1e-2, eps=1e-10, weight_decay=0.01)
        g64 = g.astype(np.float64) + 0.01 * p64
        s64 = s64 + g64 * g64
        p64 = p64 - 1e-2 * g64 / (np.sqrt(s64) + 1e-10)
    np.testing.assert_allclose(p, p64, rtol=1e-5, atol=1e-6)

    q = rng.standard_normal(n).astype(np.float32)
    mom = np.zeros(n, np.float32)
    q64, mom64 = q.astype(np.float64), np.zeros(n)
    for step in range(1, 21):
        g = rng.standard_normal(n).astype(np.float32)
        kernels.lion(q, g, mom, step=step, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
        c = 0.9 * mom64 + 0.1 * g
        q64 = q64 * (1 - 1e-4 * 0.1) - 1e-4 * np.sign(c)
        mom64 = 0.99 * mom64 + 0.01 * g
    np.testing.assert_allclose(q, q64, rtol=1e-5, atol=1e-6)


def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(4)
    n = 1 << 20
    base = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    results = []
    for threads in (1, 2, 3):
        p, m, v = base.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
        Kernels(threads=threads).adam(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                      weight_decay=0.01, adamw_mode=True, bias_correction=True)
        results.append(p)
    assert all((r == results[0]).all() for r in results)


def test_a_list_of_parameters_in_one_call_steps_each_as_alone():
    """One call over many tensors (cut across the threads mid-tensor) gives
    each the bits of a call of its own, for every rule and the 16-bit copy."""
    rng = np.random.default_rng(5)
    sizes = [300_001, 17, 0, 1 << 18, 5000]
    kernels = Kernels(threads=2)
    kw = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
              bias_correction=True)

    def fresh():
        return [dict(p=rng_p.standard_normal(n).astype(np.float32), g=rng_p.standard_normal(n).astype(np.float32),
                     m=np.full(n, 0.1, np.float32), v=np.full(n, 0.2, np.float32), c=np.zeros(n, np.uint16))
                for n in sizes]

    rng_p = np.random.default_rng(6)
    alone = fresh()
    rng_p = np.random.default_rng(6)
    together = fresh()
    copies = [t["c"] if i % 2 == 0 else None for i, t in enumerate(together)]
    for i, t in enumerate(alone):
        kernels.adam(t["p"], t["g"], t["m"], t["v"], param_copy=t["c"] if i % 2 == 0 else None, **kw)
    kernels.adam([t["p"] for t in together], [t["g"] for t in together], [t["m"] for t in together],
                 tuple(t["v"] for t in together), param_copy=copies, **kw)
    for a, b in zip(alone, together):
        for key in "pmvc":
            assert (a[key] == b[key]).all()
    for a in alone:
        kernels.adagrad(a["p"], a["g"], a["v"], step=2, lr=1e-2, eps=1e-10, weight_decay=0.01)
        kernels.lion(a["p"], a["g"], a["m"], step=2, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
    kernels.adagrad([t["p"] for t in together], [t["g"] for t in together], [t["v"] for t in together],
                    step=2, lr=1e-2, eps=1e-10, weight_decay=0.01)
    kernels.lion([t["p"] for t in together], [t["g"] for t in together], [t["m"] for t in together],
                 step=2, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
    for a, b in zip(alone, together):
        for key in "pmv":
            assert (a[key] == b[key]).all()
    del rng


def test_lists_that_do_not_line_up_are_named(kernels):
    z = [np.zeros(64, np.float32) for _ in range(8)]
    with pytest.raises(ValueError, match="grads: 1 tensors for 2 parameters: pass one per parameter"):
        call(kernels, params=[z[0], z[1]], grads=[z[2]], exp_avg=[z[3], z[4]], exp_avg_sq=[z[5], z[6]])
    with pytest.raises(ValueError, match="param_copy: 3 tensors for 2 parameters"):
        call(kernels, params=[z[0], z[1]], grads=[z[2], z[3]], exp_avg=[z[4], z[5]], exp_avg_sq=[z[6], z[7]],
             param_copy=[None] * 3)
    with pytest.raises(ValueError, match=r"exp_avg\[1\]: 32 elements, but the parameter has 64"):
        call(kernels, params=[z[0], z[1]], grads=[z[2], z[3]], exp_avg=[z[4], np.zeros(32, np.float32)],
             exp_avg_sq=[z[6], z[7]])
    misaligned = np.frombuffer(bytearray(260), np.float32, count=64, offset=1)
    with pytest.raises(ValueError, match=r"grads: its memory starts at an address that is not a multiple of its "
                                         r"4-byte elements"):
        call(kernels, grads=misaligned)
    whole = np.zeros(128, np.float32)
    with pytest.raises(ValueError, match=r"params\[1\] and exp_avg_sq\[0\] share memory"):
        call(kernels, params=[z[0], whole[:64]], grads=[z[2], z[3]], exp_avg=[z[4], z[5]],
             exp_avg_sq=[whole[32:96], z[7]])


def call(kernels, **override):
    n = 64
    args = dict(params=np.zeros(n, np.float32), grads=np.zeros(n, np.float32),
                exp_avg=np.zeros(n, np.float32), exp_avg_sq=np.zeros(n, np.float32))
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
              bias_correction=True)
    for key, value in override.items():
        (args if key in args else kw)[key] = value
    kernels.adam(args["params"], args["grads"], args["exp_avg"], args["exp_avg_sq"], **kw)


def test_bad_arguments_are_named(kernels):
    with pytest.raises(TypeError, match="params: dtype float64 is not supported here: use float32"):
        call(kernels, params=np.zeros(64))
    with pytest.raises(ValueError, match="grads: 63 elements, but the parameter has 64"):
        call(kernels, grads=np.zeros(63, np.float32))
    shared = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        call(kernels, exp_avg=shared, exp_avg_sq=shared)
    readonly = np.zeros(64, np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="params: the buffer is read-only"):
        call(kernels, params=readonly)
    with pytest.raises(ValueError, match="not contiguous"):
        call(kernels, grads=np.zeros(128, np.float32)[::2])
    with pytest.raises(ValueError, match="invalid lr = NaN: it must be finite"):
        call(kernels, lr=float("nan"))
    with pytest.raises(ValueError, match="step"):
        call(kernels, step=0)
    with pytest.raises(TypeError, match="params: expected a CPU tensor"):
        call(kernels, params=0.0)
    with pytest.raises(TypeError, match=r"params\[0\]: expected a CPU tensor"):
        call(kernels, params=[0.0] * 64)
    with pytest.raises(ValueError, match="threads = 0"):
        Kernels(threads=0)


def test_read_only_gradients_are_accepted(kernels):
    g = np.ones(64, np.float32)
    g.flags.writeable = False
    call(kernels, grads=g)


def test_bf16_moments_round_stochastically_so_v_tracks_its_ema():
    """A constant gradient: v = 1 - 0.999^t. Each step adds (1 - beta2) x
    (1 - v) to it, below half a bf16 ulp once v passes about 0.2, so v
    rounded to nearest stops there; rounded stochastically it tracks the
    f64 EMA on average."""
    n, steps = 4096, 2000
    kernels = Kernels(threads=2)
    g = np.ones(n, np.float32)
    exact = 1 - 0.999**steps  # 0.865
    means = {}
    for rounding in ("stochastic", "nearest"):
        p = np.zeros(n, np.float32)
        m, v = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
        for step in range(1, steps + 1):
            kernels.adam(p, g, m, v, step=step, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                         adamw_mode=True, bias_correction=True, rounding=rounding)
        means[rounding] = float(bf16_to_f32(v).mean())
        if rounding == "stochastic":
            assert abs(means[rounding] / exact - 1) < 0.01, means
            # Each element's rounding errors decay at beta2's rate: they add
            # up to a spread of about 0.02 here, not more.
            assert bf16_to_f32(v).std() < 0.03 and np.abs(bf16_to_f32(v) - exact).max() < 0.15
            assert abs(float(bf16_to_f32(m).mean()) - 1) < 0.01, "m tracks the gradient"
    assert means["nearest"] < 0.5 * exact, f"nearest rounding was to freeze v: {means}"


def test_stochastic_keys_follow_each_elements_index_not_the_call():
    """The random bits are keyed by (rounding_seed, step, global index):
    one call over [a, b] from `first` 0 equals separate calls with b's
    first at len(a), on any thread count; another seed or step gives other
    bits; an explicit list of firsts is taken per tensor."""
    rng = np.random.default_rng(7)
    sizes = [70_001, 13, 1 << 17]
    g = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    kw = dict(step=5, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
              bias_correction=True)

    def fresh():
        r = np.random.default_rng(8)
        return [dict(p=r.standard_normal(n).astype(np.float32),
                     m=f32_to_bf16_rne(r.standard_normal(n).astype(np.float32) * 0.1),
                     v=f32_to_bf16_rne(np.abs(r.standard_normal(n)).astype(np.float32) * 0.01)) for n in sizes]

    def run(kernels, ts, split, **extra):
        if split:
            first = 0
            for t, gg in zip(ts, g):
                kernels.adam(t["p"], gg, t["m"], t["v"], first=first, **kw, **extra)
                first += t["p"].size
        else:
            kernels.adam([t["p"] for t in ts], g, [t["m"] for t in ts], [t["v"] for t in ts], **kw, **extra)
        return ts

    def same(a, b):
        return all((x[k] == y[k]).all() for x, y in zip(a, b) for k in "pmv")

    together = run(Kernels(threads=2), fresh(), False)
    assert same(together, run(Kernels(threads=1), fresh(), True))
    assert same(together, run(Kernels(threads=3), fresh(), False, first=[0, sizes[0], sizes[0] + sizes[1]]))
    assert not same(together, run(Kernels(threads=2), fresh(), False, rounding_seed=1))
    assert not same(together, run(Kernels(threads=2), fresh(), False, first=1))
    nearest = run(Kernels(threads=2), fresh(), False, rounding="nearest")
    assert not same(together, nearest)
    # fp32 moments round no way: rounding changes nothing there.
    rs = np.random.default_rng(9)
    base = [rs.standard_normal(1000).astype(np.float32) for _ in range(3)]
    out = []
    for rounding in ("stochastic", "nearest"):
        p, m, v = (x.copy() for x in base)
        v = np.abs(v)
        Kernels(threads=1).adam(p, np.full(1000, 0.5, np.float32), m, v, rounding=rounding, **kw)
        out.append((p, m, v))
    assert all((a == b).all() for a, b in zip(*out))


def test_bad_rounding_arguments_are_named(kernels):
    with pytest.raises(ValueError, match=r'rounding = "up": use "stochastic" .* or "nearest"'):
        call(kernels, rounding="up")
    z = [np.zeros(64, np.float32) for _ in range(8)]
    with pytest.raises(ValueError, match="first: give an int from 0 .* or a list of 2 such ints"):
        call(kernels, params=[z[0], z[1]], grads=[z[2], z[3]], exp_avg=[z[4], z[5]], exp_avg_sq=[z[6], z[7]],
             first=[0])
    with pytest.raises(ValueError, match="first: give an int from 0"):
        call(kernels, first=-1)
    with pytest.raises(ValueError, match=r"passes 2\^64 - 1"):
        call(kernels, first=2**64 - 63)
    call(kernels, first=2**64 - 64)  # the last of its 64 elements is 2^64 - 1
