"""The host kernels (optim/host_kernels.py) against the torch reference arithmetic of the same
optimizer classes (the path CUDA and compiler-less hosts take): bitwise for AdamW and Lion in
every dtype setting, within the stated bound for Adafactor (whose sums are taken in another
order); the same bits at 1, 2 and 3 threads; exactly the traffic optim/traffic.py counts."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.optim import adamw as torch_adamw

from megatron_p2r.optim import host_kernels
from megatron_p2r.optim.adafactor import Adafactor, Piece
from megatron_p2r.optim.lion import Lion
from megatron_p2r.optim.precision_aware import PrecisionAwareAdamW
from megatron_p2r.optim.traffic import kernel_bytes_per_element

pytestmark = pytest.mark.skipif(not host_kernels.available(), reason="no C++ compiler for the host kernels")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ADAM_SETTINGS = list(
    itertools.product(
        ("fp32", "fp16"), ("fp32", "bf16"), (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"))
    )
)
ADAM_ARGS = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
LION_SETTINGS = list(itertools.product(("fp32", "fp16"), ("fp32", "bf16"), ("fp32", "bf16", "fp16")))


@pytest.fixture
def reference(monkeypatch):
    """Runs a function on the torch path (as without a compiler)."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(host_kernels, "available", lambda: False)
            return fn()

    return run


def _main(n: int, dtype: str, grad: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(DTYPES[dtype])
    p.grad_dtype = None  # a bf16 gradient on an fp32 main, as --main-grads-dtype bf16 sets it
    p.grad = torch.randn(n, generator=g).to(DTYPES[grad])
    return p


def _steps(make, p0: torch.Tensor, steps: int = 3):
    """The main and state after ``steps`` steps of ``make([p])``, each with a new gradient."""
    p = p0.detach().clone()
    p.grad_dtype = None
    opt = make([p])
    for i in range(steps):
        p.grad = (p0.grad * (1 + i)).clone()
        opt.step()
    return p, opt.state[p]


def _adamw(main, grad, moments, wd=0.1):
    p0 = _main(1613, main, grad)  # 1613 % 16 = 13: torch's 8-wide remainder and scalar tail too
    dtypes = dict(zip(("exp_avg", "exp_avg_sq"), (DTYPES[m] for m in moments), strict=True))
    return lambda: _steps(
        lambda ps: PrecisionAwareAdamW(ps, dtypes, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd), p0
    )


def _equal(got, want):
    (p, state), (p_ref, state_ref) = got, want
    assert torch.equal(p, p_ref)
    for name in state_ref:
        assert state[name].dtype == state_ref[name].dtype and torch.equal(state[name], state_ref[name]), name


@pytest.mark.parametrize("main,grad,moments", ADAM_SETTINGS, ids=["-".join([a, b, *c]) for a, b, c in ADAM_SETTINGS])
def test_adamw_is_the_reference_bitwise(reference, main, grad, moments):
    run = _adamw(main, grad, moments)
    _equal(run(), reference(run))


def _off_by(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> float:
    """The largest difference between two updated mains, relative to the largest step taken."""
    return float((got.double() - want.double()).abs().max() / (want.double() - before.double()).abs().max())


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_fp32_adamw_is_torchs_fused_kernel_bitwise(weight_decay, beta1):
    """All-fp32 AdamW on the host kernel is torch's fused CPU kernel to the bit, at every size:
    its 16-wide body, the 8-wide remainder and the scalar loop over the last n % 8 elements
    (which rounds the second moment another way), both sides of torch's lerp (beta1 0.3: weight
    above 0.5), at 1 and 2 threads."""
    sizes = [*range(1, 71), 4096 + 13, 200_003]
    for n, threads in itertools.product(sizes, (1, 2)):
        if threads == 2 and n < 100_000:
            continue
        g = torch.Generator().manual_seed(n)
        p, grad, m = (torch.randn(n, generator=g) for _ in range(3))
        v = torch.rand(n, generator=g)
        want = [t.clone() for t in (p, grad, m, v)]
        torch_adamw.adamw(
            *([t] for t in want),
            [],
            [torch.tensor(2.0)],
            fused=True,
            amsgrad=False,
            beta1=beta1,
            beta2=0.95,
            lr=1e-2,
            weight_decay=weight_decay,
            eps=1e-8,
            maximize=False,
        )
        try:
            host_kernels.set_threads(threads)
            host_kernels.adamw(
                p, grad, m, v, step=3, lr=1e-2, beta1=beta1, beta2=0.95, eps=1e-8, weight_decay=weight_decay
            )
        finally:
            host_kernels.set_threads(1)
        for name, got, expected in zip(
            ("param", "exp_avg", "exp_avg_sq"), (p, m, v), (want[0], want[2], want[3]), strict=True
        ):
            assert torch.equal(got, expected), f"{name} differs at n={n}: {(got != expected).nonzero().flatten()[:8]}"


def test_kernels_report_the_threads_they_ran_on():
    """``peak_threads``: the most threads a kernel call on this thread ran on since the last
    read — the configured count for a large shard, 1 below the serial threshold, 0 for none."""
    big, small = _main(200_003, "fp32", "fp32"), _main(1000, "fp32", "fp32")
    host_kernels.peak_threads()
    try:
        host_kernels.set_threads(3)
        for p in (small, big):
            host_kernels.adamw(p, p.grad, torch.zeros_like(p), torch.zeros_like(p), **ADAM_ARGS)
            assert host_kernels.peak_threads() == (3 if p is big else 1)
        assert host_kernels.peak_threads() == 0
        host_kernels.adafactor_sums(0, 401, 499, 1, big.grad[: 401 * 499], big[: 401 * 499])
        assert host_kernels.peak_threads() == 3
    finally:
        host_kernels.set_threads(1)


def test_adamw_writes_the_rounded_weight():
    p = _main(1000, "fp32", "bf16")
    g, m, v = p.grad, torch.zeros(1000), torch.zeros(1000)
    weight = torch.empty(1000, dtype=torch.bfloat16)
    host_kernels.adamw(p, g, m, v, **ADAM_ARGS, weight=weight)
    assert torch.equal(weight, p.to(torch.bfloat16))


@pytest.mark.parametrize("main,grad,moment", LION_SETTINGS, ids=["-".join(s) for s in LION_SETTINGS])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_is_the_reference_bitwise(reference, main, grad, moment, wd):
    p0 = _main(1600, main, grad)
    run = lambda: _steps(
        lambda ps: Lion([{"params": ps, "weight_decay": wd}], lr=1e-3, moment_dtype=DTYPES[moment]), p0
    )
    _equal(run(), reference(run))


# (shape, [start, end)): whole matrices, stacked experts, pieces cut mid-row and mid-matrix
PIECES = [
    ((24, 40), (0, 960)),
    ((24, 40), (13, 517)),
    ((3, 9, 11), (0, 297)),
    ((3, 9, 11), (50, 250)),
    ((70, 33), (33 * 5 + 7, 33 * 69)),
]


def _adafactor(shape, start, end, grad="fp32", wd=0.0, steps=3):
    p0 = _main(end - start, "fp32", grad, seed=start)
    return lambda: _steps(
        lambda ps: Adafactor([{"params": ps, "weight_decay": wd}], {id(ps[0]): Piece(shape, start, end)}, lr=1e-2),
        p0,
        steps,
    )


@pytest.mark.parametrize("shape,span", PIECES, ids=[f"{s}-{a}:{b}" for s, (a, b) in PIECES])
@pytest.mark.parametrize("grad", ["fp32", "bf16"])
def test_adafactor_within_its_bound(reference, shape, span, grad):
    """Element by element the reference's arithmetic; only the sums (row/column sums of g^2, the
    weight's and the update's sums of squares) are added in another order, in double where torch
    adds fp32: the statistics agree within torch's own summation error (max(rows, cols) x 2^-24
    relative) and the mains within 1e-5 of the largest step."""
    run = _adafactor(shape, *span, grad=grad, wd=0.1)
    (p, state), (p_ref, state_ref) = run(), reference(run)
    for name in ("row_var", "col_var"):
        torch.testing.assert_close(state[name], state_ref[name], rtol=max(shape[-2:]) * 2**-24, atol=0)
    assert _off_by(p, p_ref, _main(span[1] - span[0], "fp32", grad, seed=span[0])) <= 1e-5


def test_adafactor_sums_are_near_exact():
    """The kernel adds at most 64 rows (16 lanes of a row) in fp32, the rest in double: its sums
    are within 2^-18 of the exact ones (the bound above is torch's error)."""
    p = _main(330, "fp32", "fp32")
    shape = (3, 10, 11)
    sums = host_kernels.adafactor_sums(0, 10, 11, 3, p.grad, p)
    g2 = (p.grad * p.grad).double().view(30, 11)
    want = torch.cat([g2.sum(1), g2.view(3, 10, 11).sum(1).reshape(-1), (p * p).double().view(3, -1).sum(1)]).float()
    assert shape and torch.allclose(sums, want, rtol=2**-18, atol=0)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_do_not_change_results(threads):
    def run_all():
        out = [
            _steps(
                lambda ps: PrecisionAwareAdamW(ps, {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.float32}, lr=1e-2),
                _main(200_003, "fp32", "bf16"),
            ),
            _steps(lambda ps: Lion(ps, lr=1e-3, moment_dtype=torch.bfloat16), _main(200_003, "fp16", "bf16")),
        ]
        return out + [_adafactor((4, 300, 170), 1000, 4 * 300 * 170 - 77)()]

    try:
        host_kernels.set_threads(1)
        one = run_all()
        host_kernels.set_threads(threads)
        many = run_all()
    finally:
        host_kernels.set_threads(1)
    for got, want in zip(many, one, strict=True):
        _equal(got, want)


def _counted(run) -> int:
    """Bytes the kernel calls of ``run()`` read and write."""
    moved = []
    host_kernels.traffic_hook = lambda name, reads, writes: moved.append(
        sum(t.numel() * t.element_size() for t in (*reads, *writes))
    )
    try:
        run()
    finally:
        host_kernels.traffic_hook = None
    return sum(moved)


@pytest.mark.parametrize(
    "main,grad,moments", ADAM_SETTINGS[:8], ids=["-".join([a, b, *c]) for a, b, c in ADAM_SETTINGS[:8]]
)
@pytest.mark.parametrize("weight", [None, "bf16"])
def test_traffic_is_what_traffic_py_counts(main, grad, moments, weight):
    n = 1024
    p = _main(n, main, grad)
    w = None if weight is None else torch.empty(n, dtype=DTYPES[weight])
    m, v = (torch.zeros(n, dtype=DTYPES[d]) for d in moments)
    adam = _counted(
        lambda: host_kernels.adamw(
            p, p.grad, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, weight=w
        )
    )
    assert adam == n * kernel_bytes_per_element(
        "adam", main, grad, dict(zip(("exp_avg", "exp_avg_sq"), moments, strict=True)), weight
    )
    lion = _counted(lambda: host_kernels.lion(p, p.grad, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, weight=w))
    assert lion == n * kernel_bytes_per_element("lion", main, grad, {"exp_avg": moments[0]}, weight)


@pytest.mark.parametrize("grad", ["fp32", "bf16"])
def test_adafactor_traffic_is_three_passes(grad):
    """Steady state: traffic.py's count (pass 1 reads the gradient alone); the first step reads
    the main once more (its sum of squares is not known yet)."""
    shape, n = (32, 32), 1024
    per_step = n * kernel_bytes_per_element("adafactor", "fp32", grad, {}, None)
    assert _counted(_adafactor(shape, 0, n, grad=grad, steps=1)) == per_step + 4 * n
    assert _counted(_adafactor(shape, 0, n, grad=grad, steps=3)) == 3 * per_step + 4 * n


def _forgetting(monkeypatch):
    """Adafactor as if pass 3 left no sum of squares: pass 1 reads the main at every step."""
    monkeypatch.setattr(Adafactor, "_sums", _without_carried_sums(Adafactor._sums))


def _without_carried_sums(sums):
    def wrapped(self, p):
        self._weight_sq.clear()
        return sums(self, p)

    return wrapped


LONG_ROWS = [*PIECES, ((5, 1100), (700, 5 * 1100 - 300))]  # rows of several 512-element blocks


@pytest.mark.parametrize("shape,span", LONG_ROWS, ids=[f"{s}-{a}:{b}" for s, (a, b) in LONG_ROWS])
def test_adafactor_carried_weight_sums_are_the_ones_pass_1_reads(monkeypatch, shape, span):
    """The main's sum of squares pass 3 leaves for the next step is bitwise the one pass 1 would
    add up from the main: 4 steps with it and without it give the same bits."""
    run = _adafactor(shape, *span, wd=0.1, steps=4)
    carried = run()
    with monkeypatch.context() as m:
        _forgetting(m)
        _equal(carried, run())


@pytest.mark.parametrize("shape,span", LONG_ROWS, ids=[f"{s}-{a}:{b}" for s, (a, b) in LONG_ROWS])
def test_pass_3_sums_the_new_main_as_pass_1_does(shape, span):
    """The kernel level of the above: pass 3's sum of the new main's squares is bitwise pass 1's
    over the same main, whole matrices, stacked ones and pieces cut mid-row alike."""
    piece = Piece(shape, *span)
    b, r, c = piece.batches, piece.rows, piece.cols
    p = _main(span[1] - span[0], "fp32", "fp32", seed=span[0])
    g = torch.Generator().manual_seed(1)
    row_var, col_var = torch.rand(b * r, generator=g) + 0.5, torch.rand(b * c, generator=g) + 0.5
    carried = host_kernels.adafactor_apply(
        span[0], r, c, p.grad, p, row_var, col_var, torch.ones(b), 1e-30, torch.full((b,), 1e-2), 0.99
    )
    assert torch.equal(carried, host_kernels.adafactor_sums(span[0], r, c, b, p.grad, p)[-b:])


def test_adafactor_rereads_a_main_written_between_steps(monkeypatch):
    """A main changed in place between two steps (a load, a user's edit) bumps its version: pass 1
    reads it again, and the step is the one that never carried a sum."""

    def run():
        p = _main(24 * 40, "fp32", "fp32")
        grad = p.grad
        opt = Adafactor([{"params": [p]}], {id(p): Piece((24, 40), 0, 960)}, lr=1e-2)
        opt.step()
        with torch.no_grad():
            p.mul_(3.0)
        p.grad = grad * 2
        opt.step()
        return p, opt.state[p]

    edited = run()
    with monkeypatch.context() as m:
        _forgetting(m)
        _equal(edited, run())


def test_without_a_compiler_the_torch_path_steps_after_one_warning(monkeypatch, tmp_path, reference):
    """No $CXX: library() is None with one RuntimeWarning naming it, and the optimizers step with
    the torch arithmetic (the same bits as the reference)."""
    monkeypatch.setattr(host_kernels, "_state", {"threads": 1, "library": None, "tried": False})
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler \\(no-such-compiler\\)"):
        assert host_kernels.library() is None
    run = _adamw("fp32", "bf16", ("bf16", "bf16"))
    _equal(run(), reference(run))
    assert not any(tmp_path.iterdir())


def test_the_library_is_compiled_from_the_text_its_key_names(monkeypatch, tmp_path):
    """A source edited between hashing and compiling (another checkout, an editor) must not land
    in the cache under the key of the text it no longer is: the compiler reads the hashed text."""
    source = tmp_path / "kernels.cpp"
    source.write_text("// the text hashed")
    monkeypatch.setattr(host_kernels, "SOURCE", source)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    compiled = []

    def compile_while_edited(args, **kwargs):
        source.write_text("// edited meanwhile")
        compiled.append(open(args[-3]).read())
        open(args[-1], "wb").close()

    monkeypatch.setattr(host_kernels.subprocess, "run", compile_while_edited)
    host_kernels._build("g++")
    assert compiled == ["// the text hashed"]
